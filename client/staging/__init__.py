"""Staging: the host copy of a rank's tensors that a snapshot uploads from.

Problem
    ``save()`` may block the training loop only for one copy of the state
    (invariant 5), host memory must stay bounded at about one staged copy, and a
    worker that crashed must find its last staged snapshot on the node when it
    restarts (the restore tiers). Fresh memory costs ten times a copy into touched
    memory, so nothing may be allocated per save once warm.

Design
    *The pool.* One ``StagingPool`` per (job, rank) owns a directory
    ``<shm_dir>/ckptd-<uid>/<job>/rank-<rank>/`` (``shm_dir``: ``CKPTD_SHM_DIR``,
    default ``/dev/shm``; the uid keeps users of one node apart) holding:

    The control file and the index are an on-disk format, specified in
    docs/FORMAT.md ("Staging pool") and parsed into frozen values by
    ``ckptd.client.staging.format`` (``ControlHeader``, ``PoolIndex``):

    ``control``
        64 bytes, mapped shared: magic ``CKPTDSP1``, a u64 *generation* at offset
        8, the owner's pid at 16. The owner holds an exclusive ``flock`` on it for
        its lifetime, so a second live process with the same job and rank (a test
        suite, a misconfigured launch) stages into a private sibling directory
        ``rank-<rank>.<pid>-<tag>`` instead of overwriting the first one's pool;
        the lock dies with the process, so a restarted worker gets the real name.
    ``seg-<tag>-<n>``
        Segments: files sized with ``posix_fallocate`` (on tmpfs that reserves the
        pages, so a full ``/dev/shm`` is an error here and never a SIGBUS later;
        when it is full the pool falls back to an anonymous ``memfd`` segment, which
        works but does not survive the process, with a warning), mapped
        ``MAP_SHARED | MAP_POPULATE`` and viewed as one uint8 tensor each
        (``torch.from_numpy``, so a view keeps its map). Staged tensors are views
        at 64-byte (4 KiB from 64 KiB up) aligned offsets. On CUDA every segment is
        pinned with ``cudaHostRegister`` (portable) once a state with CUDA tensors is staged.
    ``index.json``
        Written atomically (temporary name, rename): the step, the generation, the
        state (``"staging"`` while copies of a new layout run, ``"staged"`` once the
        pipeline hashed them, with the chunk ids), and for every staged span its
        tensor's name, dtype (the format's name), shape and size, the byte range
        ``[start, end)`` of the tensor it holds, its first chunk's number, the
        segment and the offset. The training thread writes it only when the layout
        changes (before the copies, so no reader maps new bytes with an old
        layout); the pipeline rewrites it, off the training thread, once a piece is
        hashed.

    *Seqlock.* The generation is bumped to odd before a stage overwrites the
    buffers and back to even once the copies are complete (on a GPU: when the
    pipeline has seen the copy-done event). A reader (the failover restore, a
    future peer chunk server) reads the generation, reads the bytes, reads the
    generation again: the bytes are the indexed snapshot only when both reads
    equal the index's (even) generation. Readers verify every chunk by its hash
    anyway; the index and the generation are hints, never trusted.

    *Layouts.* A layout places each tensor, keyed by (name, dtype, shape) in
    order, and is reused while that key holds: a warm save allocates nothing and
    copies straight into cached views. When the state changes (optimizer state
    that appears after the first step), tensors are packed first-fit-decreasing
    into the existing segments and the rest go into one new segment. Segments a
    smaller state leaves empty are kept (a state that alternates does not
    reallocate) while the pool stays within 1.5 times the largest state staged
    (or within the budget); past that, empty segments are dropped, and if that is
    not enough the pool is rebuilt as one segment that fits the state exactly.

    *Budget.* ``budget`` (bytes, None: the whole state) bounds the bytes mapped.
    A state that outgrows it is staged in *pieces*: the pool is one segment of
    ``budget`` bytes; tensors are laid out in order and split at chunk boundaries
    (multiples of ``chunk_size`` from the tensor's start, so chunk ids are those of
    a whole-state save); each piece is copied, handed to the pipeline, and
    overwritten by the next only once the pipeline has hashed and uploaded it. The
    stall grows; memory does not.

    *CUDA.* A stage records an event on each device's current stream, makes a
    dedicated side stream wait for it, and issues every copy there with
    ``non_blocking=True`` into the pinned views (sources get ``record_stream`` so a
    temporary the caller frees is not reused under the copy); a second event on
    the side stream marks the copies done. ``save()`` returns once they are
    enqueued; the pipeline's hashing thread waits on the done event before reading.
    On the CPU the copies are plain synchronous ``copy_`` calls.

    *Lifetime.* ``close()`` waits for the copies, unpins, unmaps (a segment that a
    view still holds, say an error's traceback, once the view goes), and removes the
    segments, the index, the control file and the empty directories. A pool that
    is garbage collected, or alive at a normal interpreter exit, is removed the
    same way (a finalizer and an ``atexit`` hook). A process killed by a signal,
    ``os._exit``, or an interpreter exit on an uncaught exception (other than
    ``KeyboardInterrupt``) leaves its pool: that is the crash the failover tier
    restores from. ``StagingPool.open_existing`` reads such a pool;
    ``remove_stale_pools`` removes pools whose owner is gone (renamed away under
    the dead owner's lock first, so a process that claims the name meanwhile keeps
    its new pool).

Alternatives
    Per-tensor ``torch.empty`` buffers (the previous staging): private memory that
    dies with the process. ``UntypedStorage._new_shared`` (DCP's stager): one
    anonymous segment per tensor, not named by job and rank, not budgeted.
    ``torch.from_file``: no control over reservation (SIGBUS on a full tmpfs).

Testing
    ``tests/integration/test_staging.py`` (reuse counted by ``PoolStats``, budget,
    cleanup, crash leftovers, concurrency with the seqlock),
    ``tests/integration/test_snapshot_policy.py`` (on_busy), and
    ``tests/gpu/test_cuda_staging.py`` (pinned, side-stream copies; needs CUDA).

Layout of the package: ``format`` (the on-disk control file and index, frozen
typed values), ``segments`` (the pool's files, the control file, removal),
``layout`` (where each tensor sits, the staged pieces, the copies), ``index``
(writing ``index.json``), ``pool`` (``StagingPool``), ``reader``
(``StagedPoolReader``, stale pools) and ``inventory`` (a host's pools, live or
dead, for ``ckptd shm``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd.lazy import lazy_exports

if TYPE_CHECKING:
    from .layout import StagedPiece, StagedSpan, StagePlan, TensorInfo
    from .pool import StagingPool
    from .reader import StagedPoolReader, remove_stale_pools
    from .segments import PoolStats, pool_dir

# Imported when first used: ``inventory`` (``ckptd shm``, in an init container or at
# a node's boot) and ``format`` need no torch, which took seconds to import.
_EXPORTS = {
    "PoolStats": "segments",
    "StagePlan": "layout",
    "StagedPiece": "layout",
    "StagedPoolReader": "reader",
    "StagedSpan": "layout",
    "StagingPool": "pool",
    "TensorInfo": "layout",
    "pool_dir": "segments",
    "remove_stale_pools": "reader",
}

__all__ = [
    "PoolStats",
    "StagePlan",
    "StagedPiece",
    "StagedPoolReader",
    "StagedSpan",
    "StagingPool",
    "TensorInfo",
    "pool_dir",
    "remove_stale_pools",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
