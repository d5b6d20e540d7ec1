"""Scoped tokens: who may do what to which jobs (docs/SECURITY.md, "Tokens and scopes").

A token grants one role (``read`` < ``write`` < ``admin``; each includes the ones
before it) on the jobs its pattern matches: a job name, a prefix glob such as
``llm-*``, or ``*`` for every job. The tokens file holds only the SHA-256 of each
token (tokens are 256 random bits, so a fast hash is enough: nothing to brute
force), one JSON document the server re-reads when it changes::

    {"format": "ckptd.tokens", "version": 1,
     "tokens": [{"id": "a1b2c3d4", "job": "llm-*", "role": "write",
                 "sha256": "<hex>", "created_at": 1700000000.0, "note": ""}]}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from ckptd.errors import InvalidDocument, InvalidRequest

log = logging.getLogger(__name__)

Role = Literal["read", "write", "admin"]
ROLES: tuple[Role, ...] = ("read", "write", "admin")
_RANK: dict[str, int] = {role: n for n, role in enumerate(ROLES)}

# Job names are [A-Za-z0-9._-]; a pattern may add '*' (any run of characters).
JOB_PATTERN_RE = re.compile(r"^[A-Za-z0-9._*-]{1,128}$")
TOKEN_PREFIX = "ckptd_"
FORMAT = "ckptd.tokens"
VERSION = 1


def token_digest(token: str) -> str:
    """The hex SHA-256 the tokens file keeps instead of the token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_pattern(pattern: str) -> str:
    """A job name or glob (``*`` only), else ``InvalidRequest``."""
    if not JOB_PATTERN_RE.fullmatch(pattern):
        raise InvalidRequest(
            f"job pattern {pattern!r} must be a job name, a prefix like 'llm-*', or '*'"
        )
    return pattern


def check_role(role: str) -> Role:
    if role not in _RANK:
        raise InvalidRequest(f"role {role!r} is not one of {', '.join(ROLES)}")
    return role  # type: ignore[return-value]


def role_covers(held: str, needed: str) -> bool:
    """Whether role ``held`` includes role ``needed``."""
    return _RANK[held] >= _RANK[needed]


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token may do: ``role`` on the jobs ``job`` matches."""

    id: str
    job: str
    role: Role

    def may(self, role: str, job: str | None) -> bool:
        """``role`` on ``job`` (None: on at least one job this grant names)."""
        if not role_covers(self.role, role):
            return False
        return job is None or fnmatchcase(job, self.job)

    @property
    def every_job(self) -> bool:
        return self.job == "*"


# (path, id, pattern) of the '*'-inside patterns warned of: --check and the server it
# starts read the file in one process, and a reload warns only of new ones.
_WARNED: set[tuple[Path, str, str]] = set()

# The server's own --token (or CKPTD_TOKEN): admin of every job.
ROOT = Grant(id="root", job="*", role="admin")


@dataclass(frozen=True, slots=True)
class TokenEntry:
    id: str
    job: str
    role: Role
    sha256: str
    created_at: float
    note: str = ""

    def grant(self) -> Grant:
        return Grant(id=self.id, job=self.job, role=self.role)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "job": self.job, "role": self.role, "sha256": self.sha256,
                "created_at": self.created_at, "note": self.note}


# The fields ``ckptd token create`` writes in an entry; a file has no others.
_FIELDS = ("id", "job", "role", "sha256", "created_at", "note")


def parse_tokens(data: bytes, where: str = "tokens file") -> list[TokenEntry]:
    """The entries of a tokens file; ``InvalidDocument`` naming ``where`` and the entry
    if it is bad. Refuses what no ``ckptd token`` writes (a hand edit's mistakes): an
    empty file, no "tokens" list, a field of no entry, a plaintext token, one id or
    one SHA-256 twice."""

    def bad(message: str) -> InvalidDocument:
        return InvalidDocument(f"{where}: {message}", document=where)

    if not data.strip():
        raise bad(f"the file is empty, not a {FORMAT} document")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidDocument(f"{where} is not JSON: {exc}", document=where) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InvalidDocument(f"{where} is not a {FORMAT} document", document=where)
    if doc.get("version") != VERSION:
        raise InvalidDocument(f"{where} has version {doc.get('version')!r}; this ckptd reads "
                              f"version {VERSION}", document=where)
    items = doc.get("tokens")
    if not isinstance(items, list):
        raise bad('no "tokens" list (a file without tokens has "tokens": [])')
    entries: list[TokenEntry] = []
    ids: dict[str, int] = {}
    digests: dict[str, int] = {}
    for n, item in enumerate(items):
        name = f"token #{n}"
        if not isinstance(item, dict):
            raise bad(f"{name} is not an object with {', '.join(_FIELDS)}")
        if "id" in item:
            name = f"token #{n} (id {str(item['id'])!r})"
        if "token" in item:  # (a secret written down next to its hash)
            raise bad(f'{name} holds its plaintext in "token": the file keeps only each '
                      'token\'s SHA-256; remove the "token" field (and, as the token was '
                      "written down, revoke it and create another)")
        extra = sorted(str(k) for k in item if k not in _FIELDS)
        if extra:
            raise bad(f"{name} has the field {extra[0]!r}, which a tokens entry has not "
                      f"(it has {', '.join(_FIELDS)})")
        try:
            entry = TokenEntry(
                id=str(item["id"]), job=check_pattern(str(item["job"])),
                role=check_role(str(item["role"])), sha256=str(item["sha256"]).lower(),
                created_at=float(item.get("created_at", 0.0)), note=str(item.get("note", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"{name} is malformed: {exc}") from None
        if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
            raise bad(f"{name} has no SHA-256")
        if entry.id in ids:
            raise bad(f"{name} has the id of token #{ids[entry.id]}: `ckptd token revoke` "
                      "removes a token by its id, so each needs its own")
        if entry.sha256 in digests:
            raise bad(f"{name} has the SHA-256 of token #{digests[entry.sha256]}: one token "
                      "with two scopes; remove one of them")
        ids[entry.id], digests[entry.sha256] = n, n
        entries.append(entry)
    return entries


def _write(path: Path, entries: list[TokenEntry]) -> None:
    doc = {"format": FORMAT, "version": VERSION, "tokens": [e.to_json() for e in entries]}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Temporary file, fsync, rename: a reader never sees half a file. 0600: the
    # hashes are not secrets, but the file decides who gets in.
    fd, tmp = tempfile.mkstemp(prefix=".tokens-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(doc, indent=1).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_token(path: str | os.PathLike[str], job: str, role: str,
                 note: str = "") -> tuple[str, TokenEntry]:
    """Adds a new token to the file (created if absent); returns it (shown once) and
    its entry."""
    p = Path(path)
    data = p.read_bytes() if p.exists() else b""
    entries = parse_tokens(data, str(p)) if data.strip() else []  # (or a file touched first)
    if "*" in check_pattern(job)[:-1]:  # (files from before this check still load)
        raise InvalidRequest(f"job pattern {job!r}: a '*' goes only at the end, as in "
                             "'llm-*' (every job whose name starts so), or alone ('*')")
    taken = {e.id for e in entries}
    token_id = secrets.token_hex(4)
    while token_id in taken:  # (32 random bits: revoke must name one token)
        token_id = secrets.token_hex(4)
    token = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
    entry = TokenEntry(id=token_id, job=job, role=check_role(role),
                       sha256=token_digest(token), created_at=time.time(), note=note)
    _write(p, [*entries, entry])
    return token, entry


def revoke_token(path: str | os.PathLike[str], token_id: str) -> bool:
    """Removes the token with this id; False when there was none."""
    p = Path(path)
    entries = parse_tokens(p.read_bytes(), str(p)) if p.exists() else []
    kept = [e for e in entries if e.id != token_id]
    if len(kept) == len(entries):
        return False
    _write(p, kept)
    return True


def list_tokens(path: str | os.PathLike[str]) -> list[TokenEntry]:
    p = Path(path)
    return parse_tokens(p.read_bytes(), str(p)) if p.exists() else []


class TokenFile:
    """The server's view of a tokens file: digest -> grant, re-read when the file's
    modification time or size changes (checked at most once a second), so tokens
    created or revoked while the server runs count at once."""

    def __init__(self, path: str | os.PathLike[str], recheck_s: float = 1.0) -> None:
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._grants: dict[str, Grant] = {}
        self._stamp: tuple[int, int] | None = None
        self._refused: tuple[int, int] | None = None  # (the bad file last logged)
        self._checked = float("-inf")
        self._load()

    def _load(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._grants, self._stamp = {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        entries = parse_tokens(self.path.read_bytes(), str(self.path))
        for e in entries:
            if "*" in e.job[:-1] and (self.path, e.id, e.job) not in _WARNED:
                _WARNED.add((self.path, e.id, e.job))
                log.warning("%s: token %s's job pattern %r has a '*' before its end, which "
                            "`ckptd token create` no longer writes; it matches as a glob "
                            "('*' any run of characters): if a prefix ('llm-*') was meant, "
                            "revoke it and create another", self.path, e.id, e.job)
        self._grants = {e.sha256: e.grant() for e in entries}
        self._stamp = stamp

    def _refused_once(self, exc: Exception) -> None:
        """One log line per bad version of the file (not one a second)."""
        try:
            st = self.path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._refused:
            self._refused = stamp
            said = exc.message if isinstance(exc, InvalidDocument) else str(exc)
            log.warning("tokens file changed, not reloaded: %s; the %d tokens read before "
                        "still count until it is fixed", said, len(self._grants))

    def lookup(self, token: str) -> Grant | None:
        """The grant of ``token``, or None. (A dict lookup by SHA-256: the time it
        takes says nothing useful about the token.)"""
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= self.recheck_s:
                self._checked = now
                # Keep the last good grants: a half-edited file must not open or
                # close the server. (Writers replace it atomically anyway.)
                try:
                    self._load()
                except (OSError, InvalidDocument) as exc:
                    self._refused_once(exc)
            return self._grants.get(token_digest(token))


__all__ = [
    "ROLES",
    "ROOT",
    "Grant",
    "Role",
    "TokenEntry",
    "TokenFile",
    "check_pattern",
    "check_role",
    "create_token",
    "list_tokens",
    "revoke_token",
    "role_covers",
    "token_digest",
]
