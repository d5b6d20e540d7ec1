"""The dtypes the format knows, by their stable names, and their sizes.

The core does not import torch: the names here are the format's, and the client
maps them to torch dtypes."""

from __future__ import annotations

from ckptd.errors import InvalidDocument

# Stable format names -> bytes per element. Append only.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    # Added in format revision 1.4 (docs/FORMAT.md; an older reader says "unknown dtype"):
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,  # the MX block scales of MXFP8 / MXFP4
    "float4_e2m1fn_x2": 1,  # two fp4 (e2m1) values packed in each byte, as torch's
}


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise InvalidDocument(f"unknown dtype {name!r}", dtype=name) from None
