"""Hugging Face safetensors out of and into ckptd.

``export_safetensors`` (``ckptd export JOB [STEP] --safetensors DIR``) writes a
committed step's global tensors, from any world size and sharding, as sharded
safetensors files with ``model.safetensors.index.json``, streamed and verified
chunk by chunk. ``read_safetensors`` reads such a directory (or one file) for
``ckptd import``. Needs ``pip install 'ckptd[safetensors]'`` for the import;
the export writes the format itself (see ``layout``)."""

from __future__ import annotations

from .export import SafetensorsExport, export_safetensors
from .layout import parse_size
from .reader import is_safetensors, read_safetensors

__all__ = [
    "SafetensorsExport",
    "export_safetensors",
    "is_safetensors",
    "parse_size",
    "read_safetensors",
]
