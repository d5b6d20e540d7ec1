"""The pointer files the plugin writes where Lightning expects a checkpoint file:
how a path names a tag, what a pointer holds, and the checks a load makes of one
(its version, its job, its store).

A pointer is JSON: ``format``, ``version`` (1), ``job``, ``step``, ``url`` (the
plugin's), ``store_id`` (the id of the store it was saved to, ``cluster/store-id``,
or null where none was known), ``about`` (how to load it) and, for a second name
of one step, ``callbacks``: the plain values of the checkpoint callbacks' states
that this name's save held and the stored step does not (``ModelCheckpoint``'s
``last_model_path``: the step is stored as its first name, the top-k file,
saved it). A load through the pointer puts them back, so that a run resumed from
``last.ckpt`` goes on writing ``last.ckpt`` as it does with Lightning's files."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptd.errors import InvalidRequest
from ckptd.hashing import document_hash
from ckptd.lifecycle.tags import RESERVED_TAGS, TAG_RE

POINTER_FORMAT = "ckptd.lightning_pointer"
POINTER_VERSION = 1
_POINTER_MAX = 64 * 1024  # a pointer is a few hundred bytes; a real .ckpt is larger
LATEST = "latest"
ABOUT = ("a checkpoint stored by ckptd, not a torch.save file: load it with "
         "ckpt = CkptdCheckpointIO(url, job=job).load_checkpoint(this_path) (or "
         "fit(ckpt_path=this_path) with the plugin); LightningModule.load_from_checkpoint "
         "reads the file itself and cannot: build the module from ckpt['hyper_parameters'], "
         "then model.load_state_dict(ckpt['state_dict']) (docs/integrations/lightning.md)")

log = logging.getLogger(__name__)


def name_of(path: str | os.PathLike[str]) -> str:
    """A checkpoint path's file name without ``.ckpt``."""
    name = Path(os.fspath(path)).name
    return name[: -len(".ckpt")] if name.endswith(".ckpt") else name


def stem_of(path: str | os.PathLike[str]) -> str:
    """``name_of`` with what a tag may not hold made ``_`` (``epoch=0-step=10``
    becomes ``epoch_0-step_10``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name_of(path)).lstrip("._-") or "checkpoint"


def tag_for_path(path: str | os.PathLike[str]) -> str:
    """The ckptd tag a Lightning checkpoint path maps to: its ``stem_of``, cut to a
    tag's length with a hash of the whole name; a stem that is a ref's name
    (``latest.ckpt``: no tag may be named ``latest``) keeps its ``.ckpt``."""
    tag = stem_of(path)
    if tag in RESERVED_TAGS:
        tag = f"{tag}.ckpt"
    if len(tag) > 128:
        tag = f"{tag[:100]}-{document_hash(name_of(path).encode())[:16]}"
    assert TAG_RE.fullmatch(tag)
    return tag


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer document at ``path``, or None when the file is no pointer (or is
    not there). ``InvalidRequest`` in a line for a damaged one, or one of a version
    this code does not know."""
    try:
        with open(path, "rb") as f:
            data = f.read(_POINTER_MAX + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(data) > _POINTER_MAX or not data.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        if POINTER_FORMAT.encode() in data:  # one cut short (or edited): not a file to load
            raise InvalidRequest(
                f"{os.fspath(path)} is a damaged ckptd pointer (not JSON): {data[:120]!r}; "
                "remove it to load its checkpoint by its name, a tag of the job (or pass "
                "ckpt_path='latest')", path=os.fspath(path)) from None
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) \
            and version != POINTER_VERSION:
        raise InvalidRequest(
            f"{os.fspath(path)} is a ckptd pointer of version {version}, which this ckptd "
            f"does not know (it reads version {POINTER_VERSION}): load it with the ckptd "
            "that wrote it (upgrade)", path=os.fspath(path), version=version)
    if (version != POINTER_VERSION or not isinstance(doc.get("job"), str)
            or not isinstance(doc.get("step"), int)
            or not isinstance(doc.get("callbacks", {}), dict)):
        raise InvalidRequest(f"{os.fspath(path)} is a damaged ckptd pointer: {data[:200]!r}",
                             path=os.fspath(path))
    return doc


def write_pointer(path: str, job: str, step: int, url: str, store_id: str | None,
                  callbacks: Mapping[str, Any] | None = None) -> None:
    """Writes the pointer at ``path`` atomically (a temporary file, then rename)."""
    doc: dict[str, Any] = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "job": job,
                           "step": step, "url": url, "store_id": store_id, "about": ABOUT}
    if callbacks:
        doc["callbacks"] = dict(callbacks)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_pointer(path: str, doc: Mapping[str, Any], job: str, url: str,
                  store_id: str | None) -> None:
    """Refuses, in a line, a pointer of another job or of another store than the
    plugin's, by the stores' ids where both are known (one store under two URLs is
    one store). Where one is not (a pointer written before the id was kept, a store
    whose id did not read), another URL is only a warning: a server that moved
    (another address, ``localhost`` for ``127.0.0.1``) loads as it did."""
    if doc["job"] != job:
        raise InvalidRequest(f"{path} points to job {doc['job']!r}, not {job!r}: load it "
                             f"with CkptdCheckpointIO(job={doc['job']!r})", path=path)
    theirs, their_url = doc.get("store_id"), doc.get("url")
    if isinstance(theirs, str) and store_id is not None:
        if theirs == store_id:
            return
        where = f"another store (id {theirs}) than {url}'s ({store_id})"
    elif not isinstance(their_url, str) or their_url.rstrip("/") == url.rstrip("/"):
        return
    else:
        log.warning("%s points to step %s of job %s in %s, and this plugin's url is %s: "
                    "loading it from %s (without both stores' ids, whether they are one "
                    "store cannot be told; if not, load it with CkptdCheckpointIO(%r))",
                    path, doc["step"], job, their_url, url, url, their_url)
        return
    raise InvalidRequest(
        f"{path} points to step {doc['step']} of job {job} in {their_url}, {where}: load "
        f"it with CkptdCheckpointIO({their_url!r}, job={job!r}), or remove the pointer to "
        f"load the tag {tag_for_path(path)!r} of {url}'s job", path=path, url=their_url)


def plain_callbacks(checkpoint: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The JSON values of each callback's state in ``checkpoint`` (no tensors, nothing
    that holds one): what may differ between two names of one step."""
    out: dict[str, dict[str, Any]] = {}
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return out
    for key, state in callbacks.items():
        if not isinstance(key, str) or not isinstance(state, Mapping):
            continue
        plain = {k: v for k, v in state.items() if isinstance(k, str) and _json(v)}
        if plain:
            out[key] = plain
    return out


def callbacks_patch(first: Mapping[str, Mapping[str, Any]],
                    now: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The callback values of ``now`` that differ from ``first``'s (the stored step's)."""
    out: dict[str, dict[str, Any]] = {}
    for key, state in now.items():
        stored = first.get(key, {})
        diff = {k: v for k, v in state.items() if k not in stored or stored[k] != v}
        if diff:
            out[key] = diff
    return out


def apply_callbacks(checkpoint: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """Puts a pointer's ``callbacks`` values into the checkpoint loaded through it."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return
    for key, values in patch.items():
        state = callbacks.get(key)
        if isinstance(state, dict) and isinstance(values, Mapping):
            state.update(values)


def _json(value: Any) -> bool:
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(_json(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _json(v) for k, v in value.items())
    return False
