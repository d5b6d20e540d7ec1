"""DCP's ``.metadata`` is a pickle; ckptd reads it (``ckptd import`` of a user's DCP
directory) with an unpickler that builds DCP's own metadata classes and refuses
every other global, including what those modules merely import."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptd.client.step_import import _MetadataUnpickler

FS = "torch.distributed.checkpoint.filesystem"


def stack_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` with no arguments."""
    def text(s: str) -> bytes:
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b
    return (b"\x80\x04" + text(module) + text(name) + pickle.STACK_GLOBAL
            + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP)


@pytest.mark.parametrize("module,name", [
    (FS, "os.getcwd"),  # a dotted name walking into a module the DCP module imported
    (FS, "os"),  # a module it imported
    ("os", "getcwd"),
    ("builtins", "eval"),
    # classes of DCP's own modules that are not metadata records: they act when called
    (FS, "FileSystemWriter"),
    (FS, "_OverlappingCpuLoader"),
    ("torch.distributed.checkpoint.planner", "LoadPlanner"),
])
def test_globals_beyond_dcp_metadata_classes_are_refused(module: str, name: str) -> None:
    with pytest.raises(pickle.UnpicklingError):
        _MetadataUnpickler(io.BytesIO(stack_global(module, name))).load()


def test_dcp_metadata_itself_loads() -> None:
    meta = Metadata(state_dict_metadata={})
    data = pickle.dumps(meta)
    loaded = _MetadataUnpickler(io.BytesIO(data)).load()
    assert isinstance(loaded, Metadata) and loaded.state_dict_metadata == {}
    assert torch.float32 == _MetadataUnpickler(io.BytesIO(pickle.dumps(torch.float32))).load()
