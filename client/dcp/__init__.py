"""torch.distributed.checkpoint (DCP) on ckptd: ``Writer`` and ``Reader`` are a
``StorageWriter`` and a ``StorageReader`` over the same chunk store as
``Checkpointer``, so ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` work with a
ckptd server (``http://host:port``) or a local store (``file:///path``)::

    import torch.distributed.checkpoint as dcp
    from ckptd.client.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("http://ckptd:8470", job="llm", step=step))
    dcp.load(state, storage_reader=Reader("http://ckptd:8470", job="llm"))  # latest

A DCP save of one step is one ckptd checkpoint: every rank hashes and uploads the
tensors of its write items as ``sharded`` entries (the fully qualified name, the
global size and the item's box), turns the non-tensor items (which DCP hands over
``torch.save``-d) back into plain values stored as JSON in its manifest's tree,
and puts its manifest; the coordinator's ``finish`` commits, which validates that
the boxes tile every tensor. A value that is no plain JSON but loads with
``weights_only=True`` (a set, an ``io.BytesIO``) is kept as DCP handed it over, a
verified blob; on load it is read with ``weights_only=True`` again and the planner
gets bytes ckptd saved itself, so nothing from the store is ever unpickled; any
other object is refused at save (``UnsupportedValue``). ``read_metadata``
rebuilds DCP's ``Metadata`` from the committed manifests, and ``read_data`` reads
any sub-box of a stored shard from the chunks that cover it (verifying each), so a
checkpoint saved by N ranks loads into M ranks.

Checkpoint ids (for ``dcp.save(checkpoint_id=...)``) are ``<url>/<job>/<step>``, or
a bare step for the writer's or reader's own url and job.

The package: ``target`` (checkpoint ids, one storage call), ``writer``
(``Writer``: DCP's write items into the save engine's hashing and upload) and
``reader`` (``Reader``: DCP's read items through the restore engine).
"""

from .reader import Reader
from .target import checkpoint_id, ckptd_error, parse_checkpoint_id
from .writer import Writer, WriteSummary

__all__ = [
    "Reader",
    "WriteSummary",
    "Writer",
    "checkpoint_id",
    "ckptd_error",
    "parse_checkpoint_id",
]
