"""ckptd.zarr: a committed step as a read-only zarr v3 hierarchy.

    import zarr
    from ckptd.zarr import CheckpointStore
    root = zarr.open_group(store=CheckpointStore("http://127.0.0.1:8470", "llm"), mode="r")
    w = root["model/layers.0.attn.w"][0:16, :]   # fetches and verifies only those chunks

The grid and hierarchy (``ckptd.zarr.grid``, ``ckptd.zarr.hierarchy``) are pure and
belong to the core. The store reads through the client's transport (HTTP to a
server, or ``file:///path``), so it lives in ``ckptd.client.zarr_view`` and is
imported here on first use: the core never imports the client when it loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptd.client.zarr_view import CheckpointStore, open_step

__all__ = ["CheckpointStore", "open_step"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("ckptd.client.zarr_view"), name)
    globals()[name] = value
    return value
