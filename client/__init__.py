"""ckptd.client: asynchronous, deduplicated, verified checkpoints from inside a
training process.

    from ckptd.client import Checkpointer
    ckpt = Checkpointer("http://127.0.0.1:8470", job="llm", rank=r, world_size=n)
    handle = ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ...
    ckpt.restore(state)  # fills state in place, bitwise, from the latest commit

A state may hold modules, optimizers, schedulers and ``RNGState()`` themselves
(anything with ``state_dict()`` / ``load_state_dict()``).

Names are imported lazily, so ``ckptd.client.transport`` (used by the CLI) does
not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd.lazy import lazy_exports

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, SaveHandle, Shard
    from .config import CheckpointerConfig
    from .failures import CloseResult, SnapshotFailureWarning
    from .restore.restorer import RestoreResult
    from .save.snapshot import SaveResult
    from .stateful import ModelState, RNGState
    from .transport import HttpTransport, LocalTransport, Transport, open_transport

_EXPORTS = {
    "Checkpointer": "checkpointer",
    "CheckpointerConfig": "config",
    "RestoreResult": "checkpointer",
    "SaveHandle": "checkpointer",
    "Shard": "checkpointer",
    "SaveResult": "save.snapshot",
    "CloseResult": "failures",
    "SnapshotFailureWarning": "failures",
    "RNGState": "stateful",
    "ModelState": "stateful",
    "Transport": "transport",
    "HttpTransport": "transport",
    "LocalTransport": "transport",
    "open_transport": "transport",
}

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "CloseResult",
    "HttpTransport",
    "LocalTransport",
    "ModelState",
    "RNGState",
    "RestoreResult",
    "SaveHandle",
    "SaveResult",
    "Shard",
    "SnapshotFailureWarning",
    "Transport",
    "open_transport",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
