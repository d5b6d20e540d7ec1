"""Store lifecycle: retention, garbage collection, scrub, capacity, housekeeping.

Modules are imported by name (``ckptd.lifecycle.gc``); this package imports none of
them, so that ``ckptd.repository`` can use ``ckptd.lifecycle.fence`` without a cycle."""
