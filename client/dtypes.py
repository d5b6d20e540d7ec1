"""Torch dtypes and the format's stable dtype names (``ckptd.dtypes.ITEMSIZE``), a
tensor's raw bytes, and readable paths into a state dict: what the save, the
restore and the DCP adapter all speak."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ckptd.errors import InvalidRequest, RestoreError, UnsupportedValue

# torch dtype <-> the format's stable dtype names (ckptd.dtypes.ITEMSIZE).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _attr, _name in (
    ("uint16", "uint16"),
    ("uint32", "uint32"),
    ("uint64", "uint64"),
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("float8_e8m0fnu", "float8_e8m0fnu"),
    ("float4_e2m1fn_x2", "float4_e2m1fn_x2"),
):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}

if sys.byteorder != "little":  # the format's bytes are little-endian; torch's are native
    raise ImportError("ckptd.client needs a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of a torch dtype; ``UnsupportedValue`` if it has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValue(f"tensors of dtype {dtype} cannot be checkpointed") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a format dtype name."""
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise RestoreError(f"dtype {name!r} has no torch equivalent here", dtype=name) from None


def _numpy_as(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype whose numpy array holds a tensor of ``dtype``'s bytes: itself where
    numpy has it, an integer of its size where not (bfloat16, the float8s and fp4)."""
    try:
        torch.empty(1, dtype=dtype).numpy()
        return None
    except TypeError:
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            torch.empty(0, dtype=dtype).element_size()]


# dtype -> the dtype to view it as before ``numpy()`` (absent: itself)
_NUMPY_AS = {d: a for d in _DTYPE_NAMES if (a := _numpy_as(d)) is not None}


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, writable, without a copy.

    blake3 refuses bf16 numpy arrays and non-contiguous buffers; the bytes of the
    tensor's numpy array (of an integer of its size where numpy lacks the dtype)
    work for every dtype. One torch call for most tensors: a restore takes a view of
    each tensor it fills, and the four of a flat uint8 view cost 5 us each time."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise InvalidRequest("byte_view needs a contiguous CPU tensor")
    if tensor.numel():
        src = tensor.detach() if tensor.requires_grad else tensor
        as_dtype = _NUMPY_AS.get(src.dtype)
        try:
            array = (src if as_dtype is None else src.view(as_dtype)).numpy()
        except (TypeError, RuntimeError):  # (a conjugate or negative view; a new dtype)
            pass
        else:
            return array.data.cast("B")
    # (numpy's memoryview will not cast a shape with a zero in it)
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def path_str(path: Sequence[str | int]) -> str:
    """A readable path into a state dict: ``state['optim']['state'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)

