"""The format's names for torch's low-precision dtypes (revision 1.4): appended to
``ckptd.dtypes.ITEMSIZE`` (the old names keep their places), one byte each, mapped
to and from torch's dtypes by the client; a manifest holding one parses, and a
reader without the names (ckptd before 1.4) refuses it as "unknown dtype", never
misreads it. Before, ``dtype_name`` refused them ("cannot be checkpointed")."""

from __future__ import annotations

import pytest
import torch

from ckptd import dtypes
from ckptd.client.dtypes import byte_view, dtype_name, torch_dtype
from ckptd.errors import InvalidDocument
from ckptd.format import RankManifest
from ckptd.testing.manifests import rank_manifest, tensor_entry

ADDED = ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]
# The table before 1.4, in its order: append only.
BEFORE = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2"]


def test_the_names_are_appended_one_byte_each() -> None:
    assert list(dtypes.ITEMSIZE) == BEFORE + ADDED
    assert all(dtypes.itemsize(name) == 1 for name in ADDED)


@pytest.mark.parametrize("name", ADDED)
def test_the_client_maps_each_to_torchs_own_and_back(name: str) -> None:
    dtype = getattr(torch, name)
    assert dtype_name(dtype) == name and torch_dtype(name) is dtype
    bits = torch.arange(256, dtype=torch.uint8).view(16, 16).view(dtype)
    assert bytes(byte_view(bits)) == bytes(range(256))  # its raw bytes, as stored
    assert bytes(byte_view(bits.t().contiguous())) == bits.view(torch.uint8).t().contiguous(
        ).numpy().tobytes()


def _manifest(name: str) -> bytes:
    e, _ = tensor_entry("m.scale", name, [4, 8])
    return rank_manifest("j", 1, 0, 1, [e]).canonical()


@pytest.mark.parametrize("name", ADDED)
def test_a_manifest_holding_one_parses(name: str) -> None:
    m = RankManifest.parse(_manifest(name))
    assert m.entries[0].dtype == name and m.entries[0].nbytes == 32


@pytest.mark.parametrize("name", ADDED)
def test_a_reader_without_the_names_says_unknown_dtype(name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data = _manifest(name)
    for added in ADDED:  # ckptd before revision 1.4
        monkeypatch.delitem(dtypes.ITEMSIZE, added)
    with pytest.raises(InvalidDocument, match=f"unknown dtype '{name}'"):
        RankManifest.parse(data)
