"""torchft's ``CheckpointTransport`` over ckptd's peer chunk serving.

torchft heals a recovering replica group by pulling the live state of a healthy
one. ``CkptdTransport`` does that the ckptd way: the healthy group's
``send_checkpoint`` stages the state into this process's staging pool (shared
memory, one reusable copy; pinned, copied on a side stream from a GPU), hashes it
into chunks and serves them, with a rank manifest that names every chunk, from a
``PeerServer``; the recovering group's ``recv_checkpoint`` fetches the manifest
and every chunk straight into fresh tensors and checks each against its blake3
id on arrival. A chunk whose bytes do not hash to their id fails the heal with
``ChunkHashMismatch`` (torchft reports it and the step does not commit) instead
of loading garbage; nothing is unpickled on either side.

    from ckptd.client.integrations.torchft import CkptdTransport
    manager = Manager(..., checkpoint_transport=CkptdTransport(timeout=timedelta(seconds=60)))

What crosses the wire is what ckptd stores: tensors as raw bytes, every other
leaf as JSON (``ckptd.client.save.flatten``). A leaf ckptd cannot store without
pickling fails ``send_checkpoint`` with ``UnsupportedValue`` naming its path.
docs/integrations/torchft.md tells the rest.
"""

from __future__ import annotations

from .transport import CkptdTransport, HealStats

__all__ = ["CkptdTransport", "HealStats"]
