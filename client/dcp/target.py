"""Where a DCP save or load goes: checkpoint ids (``<url>/<job>/<step>``, or a
bare step for the writer's or reader's own url and job), running one storage
call against that store, and the ckptd error inside DCP's exceptions."""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlparse, urlunparse

from ckptd.errors import (
    CkptdError,
    Forbidden,
    InvalidRequest,
    Unauthorized,
)
from ckptd.format import (
    check_job,
    check_step,
)

from ..endpoint import check_url
from ..loop import run_private
from ..reach import token_refusal
from ..transport import Transport, open_transport

T = TypeVar("T")


# The manifest ``meta`` key that marks a DCP-written manifest: its tree is flat,
# ``{fqn: node}``, and ``meta["dcp"]["paths"]`` maps each fqn to DCP's object path
# (``Metadata.planner_data``: how the flat key nests in the user's state dict).
META_KEY = "dcp"


META_VERSION = 1


_SCHEMES = ("http", "https", "file")


_PREFIX = "ckptd+"  # ckptd+http://host:port/JOB/STEP, ckptd+file:///dir/JOB/STEP


def checkpoint_id(url: str, job: str, step: int) -> str:
    """The DCP checkpoint id of ``step`` of ``job`` at ``url``: ``<url>/<job>/<step>``."""
    return f"{url.rstrip('/')}/{check_job(job)}/{check_step(step)}"


def parse_checkpoint_id(value: str | os.PathLike[str]) -> tuple[str, str, int | None]:
    """``(url, job, step)`` of a ``[ckptd+]<url>/<job>/<step>`` id (``url`` an
    ``http(s)://`` server or a ``file:///`` store); the step may be ``latest``
    (None). ``InvalidRequest`` for anything else."""
    text = os.fspath(value)
    if not isinstance(text, str):
        raise InvalidRequest(f"checkpoint id {text!r} is not a string")
    parsed = urlparse(text.removeprefix(_PREFIX))
    if parsed.scheme not in _SCHEMES:
        raise InvalidRequest(f"checkpoint id {text!r} is not <http(s) or file URL>/<job>/<step>")
    parts = parsed.path.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise InvalidRequest(f"checkpoint id {text!r} lacks /<job>/<step> at the end")
    base, job, step_text = parts
    if step_text == "latest":
        step = None
    elif step_text.isdigit() and step_text.isascii():
        step = check_step(int(step_text))
    else:
        raise InvalidRequest(f"checkpoint id {text!r}: step {step_text!r} is not an integer")
    url = urlunparse(parsed._replace(path=base, params="", query="", fragment=""))
    if parsed.scheme == "file" and not base:
        raise InvalidRequest(f"checkpoint id {text!r} names no store path")
    return url, check_job(job), step


def _is_checkpoint_id(value: Any) -> bool:
    try:
        parse_checkpoint_id(value)
    except (InvalidRequest, TypeError):
        return False
    return True


def _bare_step(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return check_step(value)
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return check_step(int(value))
    return None


def _where(url: str | None, job: str | None, token: str | None) -> tuple[str, str, str | None]:
    """A storage class's url, job and token; url and token default to ``CKPTD_URL``
    and ``CKPTD_TOKEN``, and may stay unknown ("") until a checkpoint id names them.
    A url given is checked as a ``Checkpointer`` checks it (``check_url``): a
    ``host:port`` without its scheme, a path, ``""`` are refused now, in a line."""
    if url is None:
        url = os.environ.get("CKPTD_URL") or ""
        if url:
            check_url(url, "CKPTD_URL")
    else:
        check_url(url)
    if token is None:
        token = os.environ.get("CKPTD_TOKEN") or None
    return url, ("" if job is None else check_job(job)), token


def _require_where(url: str, job: str, who: str) -> None:
    if not url:
        raise InvalidRequest(
            f"{who} has no url: pass url= (or set CKPTD_URL) and job=, or a checkpoint_id "
            "such as ckptd+http://host:port/JOB/STEP"
        )
    if not job:  # (a bare step id: no variable names the job)
        raise InvalidRequest(
            f"{who} has no job: pass job= with a bare step id, or a checkpoint_id that "
            "names it, such as ckptd+http://host:port/JOB/STEP"
        )


def ckptd_error(exc: BaseException) -> CkptdError | None:
    """The ckptd error inside what ``dcp.save`` / ``dcp.load`` raised: DCP wraps a
    storage error in a ``CheckpointException`` whose ``failures[rank]`` is
    ``(error, traceback)``; the first rank's ckptd error (None when there is none).
    A failed ``read_metadata`` DCP replaces with ``AssertionError("metadata is
    None; ...")``: its error is found on the ``Reader`` that the failing load ran
    with (``Reader.metadata_error``). Causes and contexts are looked through."""
    pending, seen = [exc], set()
    while pending:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CkptdError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for rank in sorted(failures):
                inner = failures[rank]
                inner = inner[0] if isinstance(inner, tuple) else inner
                if isinstance(inner, BaseException):
                    pending.append(inner)
        pending.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return _metadata_error(exc, set())


def _metadata_error(exc: BaseException, seen: set[int]) -> CkptdError | None:
    """The failed ``read_metadata``'s error of a ``Reader`` that a frame of the
    load that raised ``exc`` (or of an error inside it) held."""
    from .reader import Reader  # (reader imports this module)

    if id(exc) in seen:
        return None
    seen.add(id(exc))
    tb = exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, Reader) and value.metadata_error is not None:
                return value.metadata_error
        tb = tb.tb_next
    failures = getattr(exc, "failures", None)
    inner = list(failures.values()) if isinstance(failures, dict) else []
    for e in [*(i[0] if isinstance(i, tuple) else i for i in inner),
              exc.__cause__, exc.__context__]:
        if isinstance(e, BaseException):
            found = _metadata_error(e, seen)
            if found is not None:
                return found
    return None


def _run(
    url: str,
    token: str | None,
    work: Callable[[Transport], Coroutine[Any, Any, T]],
    timeout: float | None,
    job: str | None = None,
    *,
    create: bool = True,
) -> T:
    """Runs ``work`` with a fresh transport on a private event loop
    (``loop.run_private``: from any thread, DCP's async_save calls from its own,
    inside a running event loop or not). ``Timeout`` after ``timeout`` seconds.
    ``create=False`` (the reader): a ``file://`` path with no store is ``NotFound``."""

    async def body() -> T:
        transport = open_transport(url, token, job=job, create=create)
        try:
            return await work(transport)
        finally:
            await transport.close()

    try:
        return run_private(body(), timeout, what=f"DCP storage call to {url}",
                           name="ckptd-dcp")
    except (Unauthorized, Forbidden) as exc:  # (said with the URL and how to pass one)
        raise token_refusal(exc, url, bool(token), job or "",
                            needs="write" if create else "read") from None
    except CkptdError:
        raise
    except Exception as exc:
        raise CkptdError(f"DCP storage call failed: {type(exc).__name__}: {exc}") from exc
