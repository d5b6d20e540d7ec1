"""``ckptd import``: an existing checkpoint brought into a store as a committed step.

Four sources: a zarr v3 hierarchy (a ``ckptd export``, or any zarr group of
arrays), a DCP checkpoint directory written by ``dcp.save`` (its ``.metadata``, a
local file the user names and never the store or the wire, read by an unpickler
that builds only DCP's metadata classes: DCP's own reader unpickles it whole), a
``torch.save`` file (``torch.load(weights_only=True)``), and Hugging Face
safetensors (``ckptd.client.integrations.safetensors``). The state is saved by a
one-rank ``Checkpointer``, so chunks, manifest and commit go through the
repository like any save; then the step is read back and compared bitwise.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import io
import logging
import pickle
import pickletools
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptd.errors import (
    CkptdError,
    Forbidden,
    IntegrityError,
    InvalidRequest,
    NotFound,
    RestoreError,
    UnsupportedValue,
)
from ckptd.zarr.hierarchy import ATTR, RAW_DTYPES

from .dtypes import dtype_name, torch_dtype
from .save.flatten import flatten
from .transport import open_transport

if TYPE_CHECKING:
    import zarr

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class ImportResult:
    step: int
    kind: str  # "zarr", "dcp", "torch" or "safetensors"
    tensors: int
    nbytes: int
    seconds: float


def read_checkpoint(source: str | Path) -> tuple[str, dict[str, Any]]:
    """(kind, state) of a zarr directory, a DCP directory, a torch.save file or
    safetensors (a file, or a directory of them with or without their index)."""
    kind, state, _ = _read(source)
    return kind, state


def _read(source: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(kind, state, the manifest ``meta`` to save it with)."""
    path = Path(source)
    from .integrations.safetensors import is_safetensors

    if is_safetensors(path):  # a .safetensors file, or a directory of them
        return _read_safetensors(path)
    return (*_read_other(path), {})


def _read_safetensors(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Its tensors at the places a ckptd export recorded (else flat, by name), and its
    ``__metadata__`` kept in the manifest's meta for an export to write back."""
    from .integrations.safetensors.layout import METADATA_META, nested_state
    from .integrations.safetensors.reader import read_source

    read = read_source(path)
    state: dict[Any, Any] = dict(read.tensors)
    if read.paths:
        try:
            state = nested_state(read.tensors, read.paths)
        except ValueError as exc:
            read.notes.append(f"the places its files record are not a state's ({exc}): "
                              "its tensors import under their names")
    for note in read.notes:
        log.warning("%s: %s", path, note)
    return "safetensors", state, ({METADATA_META: read.metadata} if read.metadata else {})


def _read_other(path: Path) -> tuple[str, dict[str, Any]]:
    if path.is_dir() and (path / "zarr.json").is_file():
        try:
            return "zarr", read_zarr(path)
        except CkptdError:
            raise
        except (ValueError, KeyError, TypeError, OSError) as exc:  # zarr's own errors
            raise InvalidRequest(f"{path} is not a readable zarr v3 hierarchy: {exc}") from None
    if path.is_dir() and (path / ".metadata").is_file():
        return "dcp", read_dcp(path)
    if path.is_file() and looks_like_torch_save(path):
        state = load_torch_save(path, "cpu", "save plain tensors instead (torch.save("
                                "model.state_dict(), PATH), or safetensors) and import that")
        if not isinstance(state, dict):
            state = {"state": state}
        return "torch", state
    if not path.exists():
        raise NotFound(f"{path} does not exist")
    raise InvalidRequest(f"{path} is neither a zarr v3 hierarchy (zarr.json), a DCP "
                         "directory (.metadata), safetensors nor a torch.save file")


def load_torch_save(path: Path, map_location: Any, advice: str) -> Any:
    """The ``torch.save`` file at ``path``, loaded with ``weights_only=True`` (never
    unpickled otherwise): ``UnsupportedValue`` naming what it holds beyond tensors and
    containers (then ``advice``), ``InvalidRequest`` in one line for a damaged file."""
    try:
        with warnings.catch_warnings():
            # (torch's warning about a pickle.dump's protocol: the refusal below says it)
            warnings.filterwarnings("ignore", message="Detected pickle protocol",
                                    category=UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedValue(
            f"{path} holds pickled objects, which ckptd does not unpickle (it loads with "
            f"torch.load(weights_only=True), which refused {refused_by(exc)}); {advice}",
            path=str(path)) from None
    except Exception as exc:  # noqa: BLE001 - see below
        # A damaged file trips torch's unpickler anywhere, with whatever its parsing
        # raised (an IndexError on its stack, a struct.error on a cut file).
        said = " ".join(str(exc).split())[:200]  # one line: torch's texts run to several
        raise InvalidRequest(f"{path} is not a readable torch.save file: "
                             f"{type(exc).__name__}: {said}", path=str(path)) from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_OPERAND = re.compile(r"Unsupported operand (\d+)")
_OPCODES = {ord(op.code): op for op in pickletools.opcodes}


def refused_by(exc: BaseException) -> str:
    """What torch's weights_only unpickler refused, in a few words: its text is a
    dozen lines with terminal bold codes, what it refused after "WeightsUnpickler
    error:" on that line or the next (the last line that has one, in another torch)."""
    lines = [" ".join(line.split()) for line in _ANSI.sub("", str(exc)).splitlines()]
    lines = [line for line in lines if line]
    said = ""
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            said = line.split("WeightsUnpickler error:", 1)[1].strip()
            if not said and i + 1 < len(lines):
                said = lines[i + 1]
            said = said.split(". ", 1)[0].rstrip(".")
            break
    if (found := _GLOBAL.search(said)) is not None:
        return f"the object {found[1]}"
    if (found := _OPERAND.search(said)) is not None and int(found[1]) in _OPCODES:
        op = _OPCODES[int(found[1])]
        return f"pickle protocol {op.proto}, a pickle.dump's ({op.name}; torch.save writes 2)"
    if said:
        return said[:200]
    return lines[0][:200] if lines else type(exc).__name__


def looks_like_torch_save(path: Path) -> bool:
    """A zip archive (torch.save since 1.6) or a pickle (the legacy format): anything
    else is not a checkpoint, and torch's unpickler would only say so in a traceback."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


# -- zarr ----------------------------------------------------------------------------


def _tensor(arr: np.ndarray, dtype: str | None) -> torch.Tensor:
    """A numpy array as a torch tensor, raw bits reinterpreted as ``dtype``."""
    arr = np.array(arr, order="C", copy=True)  # ascontiguousarray would make 0-d 1-d
    if dtype in RAW_DTYPES:
        signed = {2: np.int16, 1: np.uint8}[arr.dtype.itemsize]
        return torch.from_numpy(arr.view(signed)).view(torch_dtype(dtype))
    return torch.from_numpy(arr)


def read_zarr(path: Path) -> dict[str, Any]:
    import zarr  # (here: a safetensors or DCP import needs no zarr)

    root = zarr.open_group(store=str(path), mode="r")
    meta = root.attrs.get(ATTR)
    if isinstance(meta, dict) and "tree" in meta and "arrays" in meta:
        return _from_tree(root, meta["tree"], meta["arrays"])
    return _from_group(root)


def _array(root: zarr.Group, path: str) -> torch.Tensor:
    import zarr

    arr = root[path]
    if not isinstance(arr, zarr.Array):
        raise InvalidRequest(f"{path} in the zarr hierarchy is not an array")
    info = arr.attrs.get(ATTR)
    dtype = info.get("dtype") if isinstance(info, dict) else None
    return _tensor(np.asarray(arr[...]), dtype)


def _from_tree(root: zarr.Group, tree: Any, paths: dict[str, str]) -> dict[str, Any]:
    """The exact state a ckptd export describes (int keys, tuples, NaN included)."""

    def build(node: dict[str, Any]) -> Any:
        ((kind, body),) = node.items()
        if kind == "dict":
            return {key: build(child) for key, child in body}
        if kind == "list":
            return [build(child) for child in body]
        if kind == "tuple":
            return tuple(build(child) for child in body)
        if kind == "tensor":
            return _array(root, paths[body])
        if kind == "bytes":  # (a blob, as it was saved: its 1-D uint8 array's bytes)
            return _array(root, paths[body]).numpy().tobytes()
        if kind == "float":
            return float(body)
        return body

    state = build(tree)
    if not isinstance(state, dict):
        raise InvalidRequest("the exported tree is not a dict at its root")
    return state


def _from_group(group: zarr.Group) -> dict[str, Any]:
    """Any zarr group: subgroups as dicts, arrays as tensors, attributes as values."""
    import zarr

    state: dict[str, Any] = {k: v for k, v in group.attrs.items() if k != ATTR}
    for name, member in group.members():
        if isinstance(member, zarr.Group):
            state[name] = _from_group(member)
        else:
            info = member.attrs.get(ATTR)
            dtype = info.get("dtype") if isinstance(info, dict) else None
            state[name] = _tensor(np.asarray(member[...]), dtype)
    return state


# -- DCP ------------------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # the checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and torch dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in _DCP_MODULES and "." not in name:
            # Only a record the module itself defines (a dataclass or an enum): a
            # module also holds what it imported (``os``, functions), a dotted name
            # would walk into them, and its other classes (readers, writers, loaders
            # that start threads) do things when a pickle calls them.
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module and (
                    is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, "
                                     "which ckptd does not load")


def read_dcp(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from .dcp.values import deliver_value

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            data = (Path(self.path) / ".metadata").read_bytes()
            try:
                metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            except (pickle.UnpicklingError, EOFError, AttributeError) as exc:
                raise InvalidRequest(f"{path}/.metadata is not DCP metadata: {exc}") from None
            if not isinstance(metadata, Metadata):
                raise InvalidRequest(f"{path}/.metadata is not DCP metadata")
            storage_meta = metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        """Non-tensor values with ``torch.load(weights_only=True)`` (DCP's own
        planner uses ``weights_only=False``): an object is refused, never built."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsupportedValue(
                    f"{read_item.dest_index.fqn!r} in {path} is an object that weights_only "
                    f"loading refuses ({refused_by(exc)})",
                    name=read_item.dest_index.fqn,
                ) from None
            deliver_value(self, read_item, obj)  # (as DCP's own, without its unpickling)

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=SafeReader(str(path)),
                         planner=SafePlanner(), no_dist=True)  # type: ignore[no-untyped-call]
    except CheckpointException as exc:  # DCP wraps what failed, ours included
        causes = [pair[0] for pair in exc.failures.values()]
        typed = next((e for e in causes if isinstance(e, CkptdError)), None)
        if typed is not None:
            raise typed from None
        raise InvalidRequest(f"{path} could not be read as a DCP checkpoint: {exc}") from None
    return state


# -- the import -------------------------------------------------------------------------


def import_checkpoint(
    source: str | Path,
    url: str,
    job: str,
    step: int,
    *,
    token: str | None = None,
    chunk_size: int | None = None,
    shm_dir: str | Path | None = None,
    verify: bool = True,
    exclude: str | Sequence[str] = (),
) -> ImportResult:
    """Saves the checkpoint at ``source`` as step ``step`` of ``job`` and commits it.
    ``exclude``: leave out the tensors whose names (``model.0.weight``) start with
    this prefix, or one of these."""
    from .checkpointer import Checkpointer
    from .integrations.safetensors.layout import prefixes

    t0 = time.perf_counter()
    unwanted = prefixes(exclude, "exclude")
    kind, state, meta = _read(source)
    if unwanted:
        state = without(state, unwanted, source)
    check_dtypes(state, source)
    flat = flatten(state)  # refuses what ckptd cannot store, naming the path
    if asyncio.run(_exists(url, token, job, step)):
        raise InvalidRequest(f"step {step} of {job} already exists; import as another --step")
    ckpt = Checkpointer(url, job, rank=0, world_size=1, token=token, chunk_size=chunk_size,
                        shm_dir=shm_dir, serve_peers=False)
    try:
        try:
            handle = ckpt.save(step, state, meta=meta)
        except Forbidden as exc:
            if exc.detail.get("needs") != "write":
                raise
            # (The checkpointer's own words name token= and this Checkpointer, which
            # the command line's user never made.)
            raise Forbidden(
                f"the token given may read job {job!r} but not write it, and an import "
                f"writes a step: pass a token of role write on the job (ckptd token create "
                f"--job {job} --role write) with --token (token= in Python) or CKPTD_TOKEN",
                job=job, needs="write") from None
        result = handle.wait()
        if result.state != "committed":
            raise RestoreError(f"step {step} of {job} did not commit ({result.state})")
        if verify:
            _read_back(ckpt, step, flat.tensors)
    finally:
        ckpt.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in flat.tensors)
    return ImportResult(step, kind, len(flat.tensors), nbytes, time.perf_counter() - t0)


def _held(dtype: torch.dtype) -> bool:
    try:
        dtype_name(dtype)
    except UnsupportedValue:
        return False
    return True


def _leaves(state: Any) -> Iterator[tuple[str, Any]]:
    """(ckptd name, value) of every leaf of a state, as ``flatten`` names them."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, str(k)), v) for k, v in reversed(value.items()))
        elif isinstance(value, list | tuple):
            stack.extend(((*path, str(i)), v) for i, v in reversed(list(enumerate(value))))
        else:
            yield ".".join(path), value


def check_dtypes(state: Any, source: str | Path) -> None:
    """Refuses, naming the tensor and saying what to do, a tensor of a dtype that
    ckptd's format has no name for (``ckptd.dtypes``: complex32, the quantized and
    bits dtypes, ...), which DCP and torch.save hold."""
    for name, value in _leaves(state):
        if isinstance(value, torch.Tensor) and not _held(value.dtype):
            dtype = str(value.dtype).removeprefix("torch.")
            raise UnsupportedValue(
                f"{name!r} in {source} is {dtype}, and ckptd's checkpoint format has no "
                f"{dtype} (docs/FORMAT.md#dtypes); import its bits as uint8 instead (save "
                f"t.view(torch.uint8); after a restore, .view(torch.{dtype}) gives it back "
                f"bitwise), or leave it out (ckptd import --exclude {name}; "
                f"ckptd.client.step_import.import_checkpoint(..., exclude=[{name!r}]) in "
                "Python)",
                name=name, dtype=dtype)


def without(state: Any, exclude: tuple[str, ...], source: str | Path) -> Any:
    """``state`` less the tensors whose ckptd names start with one of ``exclude``
    (only mapping entries: a list's later items would take other names).
    ``InvalidRequest`` when a prefix leaves out nothing (a typo)."""
    used: set[str] = set()

    def dropped(value: Any, path: tuple[str, ...]) -> bool:
        name = ".".join(path)
        hit = [p for p in exclude if name.startswith(p)]
        if not hit or not isinstance(value, torch.Tensor):
            return False
        used.update(hit)
        return True

    def keep(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: keep(v, (*path, str(k))) for k, v in value.items()
                    if not dropped(v, (*path, str(k)))}
        if isinstance(value, list | tuple):
            for i, v in enumerate(value):
                if dropped(v, (*path, str(i))):
                    raise InvalidRequest(
                        f"exclude= names {'.'.join((*path, str(i)))!r} of {source}, an item of "
                        "a list, whose later items would take other names; leave out the "
                        f"whole list ({'.'.join(path)!r}) or remove it from the checkpoint")
            items = [keep(v, (*path, str(i))) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    kept = keep(state, ())
    unused = [p for p in exclude if p not in used]
    if unused:
        raise InvalidRequest(f"exclude= {unused[0]!r} starts no name of a tensor in {source}; "
                             "check it, or leave it out")
    return kept


async def _exists(url: str, token: str | None, job: str, step: int) -> bool:
    transport = open_transport(url, token, job=job)
    try:
        return any(s.step == step for s in await transport.list_steps(job))
    finally:
        await transport.close()


def _read_back(ckpt: Any, step: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Restores the step just committed and compares it bitwise with the source."""
    restored: dict[str, Any] = {}
    ckpt.restore(restored, step=step)
    flat = dict(flatten(restored).tensors)
    for name, tensor in tensors:
        got = flat.get(name)
        if got is None or got.dtype != tensor.dtype or got.shape != tensor.shape or not (
            torch.equal(_bits(got), _bits(tensor))
        ):
            raise IntegrityError(f"imported tensor {name!r} did not read back bitwise", name=name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
