"""Where an export writes until it is whole: a staging directory beside the one
asked for, ``DIR.partial-<hex>``, renamed onto ``DIR`` once every file is in it.

A reader never finds half an export at ``DIR``: it appears complete, by one rename
(no copy of the data), or not at all. A failed or interrupted export removes its
staging directory and the parent directories it made, leaving the place as the
command found it. Only a process killed outright (``kill -9``, a lost node) leaves
a staging directory behind; its name says ``partial``, no export is opened at it,
and it can be deleted.

An existing empty ``DIR`` (a mount point, a directory in a parent the user cannot
write) is kept as it is: the staging directory is made inside it, and at the end
its entries are renamed up into ``DIR``, the one a reader opens first (zarr's root
``zarr.json``, the safetensors index) last.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.errors import InvalidRequest

PARTIAL = ".partial-"  # in the name of every staging directory


@dataclass(slots=True)
class Staging:
    """An export's staging directory (``path``) for ``target``, until published."""

    target: Path  # as the caller named it (the messages say it so)
    path: Path
    inside: bool  # made inside an existing empty target
    made: list[Path]  # parent directories this export made, deepest first
    moved: list[Path] = field(default_factory=list)  # entries renamed up into the target


def write_advice(exc: OSError) -> str:
    """What to do about a write into the export's directory that the system refused,
    by its errno: room is only the answer to a full disk or a quota."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there or export elsewhere"
    if exc.errno == errno.EFBIG:  # (a limit on one file: ulimit -f, the filesystem's own)
        return ("a file passed the size limit on one file (ulimit -f, or the filesystem's): "
                "raise it, lower --max-shard-size (safetensors) or export elsewhere")
    if exc.errno == errno.EROFS:
        return "that filesystem is mounted read-only: export elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "this user may not write there: export into a directory you can write"
    return "export elsewhere"


def check_target(target: Path) -> None:
    """Refuses a target that exists and is not an empty directory: an export never
    writes over anything (a stopped export's leftover in it is named)."""
    if not target.exists():
        return
    names = sorted(p.name for p in target.iterdir()) if target.is_dir() else [""]
    if not names:
        return
    if all(PARTIAL in name for name in names):
        raise InvalidRequest(f"{target} holds {names[0]}, left by an export that was killed "
                             "midway; delete it and export again")
    raise InvalidRequest(f"{target} exists and is not an empty directory; "
                         "export into a new one")


def stage(target: Path) -> Staging:
    """Makes the staging directory of ``target`` (as ``check_target`` passed it):
    beside it, its missing parents made, or inside it when it is an existing empty
    directory. An ``OSError`` is the caller's to word (it names ``target``)."""
    where = Path(os.path.abspath(target))
    made: list[Path] = []
    inside = where.is_dir()
    parent = where if inside else where.parent
    missing = parent
    while not missing.exists() and missing != missing.parent:
        made.append(missing)
        missing = missing.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for _ in range(16):
            path = parent / f"{where.name}{PARTIAL}{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                path.mkdir()  # (mode 0o777 less the umask, as DIR's own would be)
                return Staging(target, path, inside, made)
        raise FileExistsError(errno.EEXIST, "no free name for a staging directory", str(parent))
    except BaseException:
        _remove_made(made)
        raise


def publish(staging: Staging, last: str) -> None:
    """Puts the complete export at its target: one rename, or, inside an existing
    target, one per entry with ``last`` last. A target that appeared meanwhile
    (not empty) is refused; ``discard`` then removes the export."""
    where = Path(os.path.abspath(staging.target))
    try:
        if not staging.inside:
            os.rename(staging.path, where)  # (onto a name nothing held at the start)
            return
        for name in sorted(os.listdir(staging.path), key=lambda name: name == last):
            staging.moved.append(where / name)  # (before: an interrupt may land after)
            os.rename(staging.path / name, where / name)
        staging.path.rmdir()
    except OSError as exc:
        if staging.moved and os.path.lexists(staging.path / staging.moved[-1].name):
            staging.moved.pop()  # (not moved: what holds its name is not this export's)
        raise InvalidRequest(f"{staging.target} was written by another program while this "
                             f"export ran ({exc.strerror or exc}); nothing of this export "
                             "is left there: export into a new directory") from None


def discard(staging: Staging) -> None:
    """Removes what the export wrote and the parent directories it made. What
    refused the writes may refuse this too (a read-only filesystem): the error the
    export met is the one said."""
    for moved in staging.moved:
        with contextlib.suppress(OSError):
            if moved.is_dir() and not moved.is_symlink():
                shutil.rmtree(moved, ignore_errors=True)
            else:
                moved.unlink(missing_ok=True)
    shutil.rmtree(staging.path, ignore_errors=True)
    _remove_made(staging.made)


def _remove_made(made: list[Path]) -> None:
    for path in made:  # (deepest first; one that holds something else stays)
        try:
            path.rmdir()
        except OSError:
            return
