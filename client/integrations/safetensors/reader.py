"""Safetensors checkpoints read for ``ckptd import``: a Hugging Face directory
(an index, ``model.safetensors.index.json`` or any one ``*.safetensors.index.json``
such as diffusers' ``diffusion_pytorch_model.safetensors.index.json``, and the files
its weight map names; or one ``.safetensors`` file in it) or a single
``.safetensors`` file, read with the ``safetensors`` package (which never
unpickles): its tensors by name, where a ckptd export's files say so their places
in the state it saved (``layout.PATHS_KEY``), and the rest of the files'
``__metadata__``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptd.errors import InvalidRequest, UnsupportedValue

from .layout import INDEX_NAME, PATHS_KEY

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


def _count(n: int, what: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file or a directory that holds a
    safetensors index or safetensors files."""
    if path.is_file():
        return path.suffix == SUFFIX
    return path.is_dir() and (bool(_indexes(path)) or any(path.glob(f"*{SUFFIX}")))


def _indexes(path: Path) -> list[Path]:
    """The safetensors indexes in a directory: ``model.safetensors.index.json`` when
    it is there (what Hugging Face writes and reads first), else every
    ``*.safetensors.index.json`` (diffusers', a library's own name)."""
    if (path / INDEX_NAME).is_file():
        return [path / INDEX_NAME]
    return sorted(p for p in path.glob(f"*{INDEX_SUFFIX}") if p.is_file())


@dataclass(slots=True)
class SafetensorsSource:
    """A safetensors checkpoint as read: its tensors by name (in the state-dict order
    its files record, else file order), the places in a state that its files record
    for them (``PATHS_KEY``), the ``__metadata__`` its files agree on (``PATHS_KEY``
    left out), and what of their metadata was not taken, and why."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    paths: dict[str, object] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: int = 0
    dropped: set[str] = field(default_factory=set)

    def add(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
            ) -> None:
        """Takes one file's tensors (all of them: the caller checked) and metadata."""
        places = self._places(path, tensors, metadata)
        for name in places if places is not None else tensors:
            self.tensors[name] = tensors[name]
        self.paths.update(places or {})
        metadata = {k: v for k, v in metadata.items() if k != PATHS_KEY}
        if self.files == 0:
            self.metadata = metadata
        else:
            for key in sorted((self.metadata.keys() | metadata.keys()) - self.dropped):
                if self.metadata.get(key) != metadata.get(key):
                    self.metadata.pop(key, None)
                    self.dropped.add(key)
                    self.notes.append(f"the files' __metadata__ differ on {key!r}: not kept")
        self.files += 1

    def _places(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
                ) -> dict[str, object] | None:
        text = metadata.get(PATHS_KEY)
        if text is None:
            return None
        try:
            places = json.loads(text)
        except ValueError:
            places = None
        if not isinstance(places, dict) or places.keys() != tensors.keys():
            self.notes.append(f"{PATHS_KEY} of {path.name} does not name its tensors: they "
                              "import under their names")
            return None
        return places


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or directory, by name."""
    return read_source(path).tensors


def read_source(path: Path) -> SafetensorsSource:
    """A safetensors file or directory: its tensors, their places, its metadata."""
    if path.is_file():
        return _single(path)
    indexes = _indexes(path)
    if len(indexes) == 1:
        return _read_indexed(path, indexes[0])
    if indexes:
        names = ", ".join(p.name for p in indexes)
        raise InvalidRequest(f"{path} holds {len(indexes)} safetensors indexes ({names}), each "
                             "a checkpoint of its own; import one: copy it and the files its "
                             "weight_map names into a directory of their own")
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) != 1:
        raise InvalidRequest(f"{path} holds {_count(len(files), '.safetensors file')} and no "
                             f"*{INDEX_SUFFIX} saying which tensor is where; import one file, "
                             "or add the index")
    return _single(files[0])


def _single(path: Path) -> SafetensorsSource:
    source = SafetensorsSource()
    source.add(path, *_read_file(path))
    return source


def _read_indexed(path: Path, index: Path) -> SafetensorsSource:
    try:
        doc = json.loads(index.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{index} is not JSON: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidRequest(f"{index} has no weight_map of tensor names to file names")
    files: dict[str, list[str]] = {}
    for name, filename in weight_map.items():
        if "/" in filename or "\\" in filename or filename in ("", ".", ".."):
            raise InvalidRequest(f"{index} maps {name!r} to {filename!r}, which is not a file "
                                 f"name in {path}")
        files.setdefault(filename, []).append(name)
    source = SafetensorsSource()
    for filename in sorted(files):
        tensors, metadata = _read_file(path / filename)
        missing = sorted(set(files[filename]) - tensors.keys())
        if missing:
            raise InvalidRequest(f"{filename} lacks {_count(len(missing), 'tensor')} that "
                                 f"{index.name} puts there (first: {missing[0]!r})")
        # A tensor of the file that the index puts elsewhere or nowhere would be left
        # out without a word (loaders that read whole files would take it).
        unmapped = sorted(tensors.keys() - set(files[filename]))
        if unmapped:
            raise InvalidRequest(f"{filename} holds {_count(len(unmapped), 'tensor')} that "
                                 f"{index.name} does not put there (first: {unmapped[0]!r}); "
                                 "fix the index, or import the files one at a time")
        source.add(path / filename, {name: tensors[name] for name in files[filename]},
                   metadata)
    return source


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A file's tensors (in file order) and its ``__metadata__``."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise InvalidRequest("reading safetensors needs the safetensors package: "
                             "pip install 'ckptd[safetensors]'") from None
    if not path.is_file():
        raise InvalidRequest(f"{path} does not exist or is not a file")
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            names = f.keys()  # (in file order)
            for name in names:
                out[name] = _tensor(f, name, path)
    except SafetensorError as exc:
        raise InvalidRequest(f"{path} is not a readable safetensors file: "
                             f"{' '.join(str(exc).split())}") from None
    return out, {k: v for k, v in metadata.items() if isinstance(k, str) and isinstance(v, str)}


def _tensor(f: Any, name: str, path: Path) -> torch.Tensor:
    try:
        tensor = f.get_tensor(name)
    except (TypeError, ValueError, RuntimeError) as exc:  # a dtype torch has not
        raise UnsupportedValue(f"{name!r} in {path} cannot be read as a torch tensor: "
                               f"{' '.join(str(exc).split())}", name=name) from None
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequest(f"{name!r} in {path} is not a tensor")
    return tensor
