"""Hugging Face safetensors out of and into ckptd.

``export_safetensors`` (``ckptd export JOB [STEP] --safetensors DIR``) writes a
committed step's global tensors, from any world size and sharding, as sharded
safetensors files with ``model.safetensors.index.json``, streamed and verified
chunk by chunk, each file recording its tensors' places in the saved state.
``read_safetensors`` reads such a directory (or one file) for ``ckptd import``,
which puts the tensors back at those places. Needs ``pip install
'ckptd[safetensors]'`` for the import; the export writes the format itself (see
``layout``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd.lazy import lazy_exports

if TYPE_CHECKING:
    from .export import SafetensorsExport, export_safetensors
    from .layout import parse_size
    from .reader import is_safetensors, read_safetensors

# Imported when first named: ``layout`` (the format, ``parse_size``) needs no torch,
# so the command line checks ``--max-shard-size`` before it pays for torch.
_EXPORTS = {
    "SafetensorsExport": "export",
    "export_safetensors": "export",
    "parse_size": "layout",
    "is_safetensors": "reader",
    "read_safetensors": "reader",
}

__all__ = [
    "SafetensorsExport",
    "export_safetensors",
    "is_safetensors",
    "parse_size",
    "read_safetensors",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
