"""The census's worker: a ``SpaceBook`` in a child process of its own
(``python -m ckptd.lifecycle.census_worker``), reniced, that reads manifests and
does the counting, so that a server's event loop and its document thread never
do; and the same book on a thread of this process (``inline``: the CLI).

The two talk over the child's stdin and stdout, one call at a time: a header of
JSON (the method and its arguments; ``{"$bytes": i}`` stands for the i-th binary
frame that follows), then the frames, each with its length. No pickle: the child
is ours, but nothing that crosses a pipe is ever unpickled. The child ends when
its stdin closes: a server killed with SIGKILL leaves no worker behind. It starts
at the first call that an empty book cannot answer here: a server over an empty
store starts none until the first step to count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptd.errors import CkptdError
from ckptd.lifecycle.book_views import Begun, BookError, BookView, JobView

if TYPE_CHECKING:
    from ckptd.lifecycle.space_book import SpaceBook

_HEAD = struct.Struct("<I")
_FRAME = struct.Struct("<Q")
# Methods the book answers; their results are turned into plain JSON values here.
METHODS = frozenset({"begin", "add_ranks", "finish", "load", "abort", "drop", "clear",
                     "listing", "listed", "view"})


class WorkerLost(CkptdError):
    """The census worker process died, or a call to it was cut off: its book is gone."""

    code = "internal"


def _pack(value: Any, frames: list[bytes]) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        frames.append(bytes(value))
        return {"$bytes": len(frames) - 1}
    if isinstance(value, list | tuple):
        return [_pack(v, frames) for v in value]
    if isinstance(value, dict):
        return {k: _pack(v, frames) for k, v in value.items()}
    return value


def _unpack(value: Any, frames: list[bytes]) -> Any:
    if isinstance(value, dict) and set(value) == {"$bytes"}:
        return frames[value["$bytes"]]
    if isinstance(value, list):
        return [_unpack(v, frames) for v in value]
    if isinstance(value, dict):
        return {k: _unpack(v, frames) for k, v in value.items()}
    return value


def _encode(message: Any) -> bytes:
    frames: list[bytes] = []
    head = json.dumps([_pack(message, frames), len(frames)]).encode()
    parts = [_HEAD.pack(len(head)), head]
    for frame in frames:
        parts += [_FRAME.pack(len(frame)), frame]
    return b"".join(parts)


def _answer_of_empty_book(method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, the answer) of a call that an empty book answers the same whatever it
    was told before, else (False, None): its view; dropping, aborting or clearing
    what it does not hold; a listing of ``chunks/`` that begins (a new book has
    orphaned nothing), or that found no chunk (the same as none: every chunk a step
    counted later names is new to both)."""
    if method == "view":
        return True, BookView((), 0, 0, 0)
    if method in ("drop", "abort", "clear", "listing") or (method == "listed" and not args[0]):
        return True, None
    return False, None


def _to_plain(method: str, result: Any) -> Any:
    if isinstance(result, Begun | BookView):
        return asdict(result)
    return result


def _from_plain(method: str, result: Any) -> Any:
    if method == "begin":
        return Begun(**result)
    if method == "view":
        jobs = tuple(JobView(j["job"], j["stored_bytes"], j["logical_bytes"],
                             tuple(tuple(s) for s in j["steps"])) for j in result["jobs"])
        return BookView(**{**result, "jobs": jobs})
    return result


# -- the child ---------------------------------------------------------------------------


def _read_message(stream: BinaryIO) -> Any | None:
    head = stream.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    body, count = json.loads(stream.read(_HEAD.unpack(head)[0]))
    frames = [stream.read(_FRAME.unpack(stream.read(_FRAME.size))[0]) for _ in range(count)]
    return _unpack(body, frames)


def main() -> None:
    """The worker's loop: a call in, its answer out, until stdin closes."""
    niceness = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if niceness:
        with contextlib.suppress(OSError):
            os.nice(niceness)
    book = _new_book()
    read, write = sys.stdin.buffer, sys.stdout.buffer
    while (message := _read_message(read)) is not None:
        method, args = message
        t0 = time.process_time()
        try:
            if method not in METHODS:
                raise BookError(f"no such census method {method!r}")
            answer = {"ok": _to_plain(method, getattr(book, method)(*args))}
        except BookError as exc:
            answer = {"book_error": str(exc)}
        except Exception as exc:  # a bug: said, and the worker (and its book) go on
            answer = {"book_error": f"the census worker failed: {exc!r}"}
        answer["cpu"] = time.process_time() - t0
        write.write(_encode(answer))
        write.flush()


def _new_book() -> SpaceBook:
    """An empty book, numpy imported with it: in the worker's process, or inline
    (the CLI); a server that starts a worker never imports either."""
    from ckptd.lifecycle.space_book import SpaceBook

    return SpaceBook()


# -- the parent --------------------------------------------------------------------------


class Worker:
    """Calls a book: in a child process (``process``), or on a thread here."""

    def __init__(self, *, process: bool, niceness: int = 10) -> None:
        self.process = process
        self.niceness = niceness  # the child's, below the server's
        # Inline only: a server's book is its child's (numpy is imported there).
        self._book: SpaceBook | None = None if process else _new_book()
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.starts = 0  # child processes started, the first included

    async def call(self, method: str, *args: Any) -> tuple[Any, float]:
        """(The book's answer, CPU seconds it took in the child); ``BookError`` as
        the book raised it, ``WorkerLost`` when the child died or the call was cut
        off (the next call starts a new child, with an empty book)."""
        if not self.process:
            assert self._book is not None  # (not a process: an inline book)
            return await asyncio.to_thread(getattr(self._book, method), *args), 0.0
        async with self._lock:
            if self._child is None:  # (no child: the book is empty, a new child's too)
                answered, result = _answer_of_empty_book(method, args)
                if answered:
                    return result, 0.0
            child = await self._started()
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(_encode([method, list(args)]))
                await child.stdin.drain()
                head = await child.stdout.readexactly(_HEAD.size)
                body, count = json.loads(await child.stdout.readexactly(_HEAD.unpack(head)[0]))
                frames = []
                for _ in range(count):
                    size = _FRAME.unpack(await child.stdout.readexactly(_FRAME.size))[0]
                    frames.append(await child.stdout.readexactly(size))
            except BaseException as exc:
                # Cut off mid-call (cancelled, or the child died): what the child
                # says next would answer the wrong call, so it goes.
                await self._kill()
                if isinstance(exc, Exception):
                    raise WorkerLost(f"the census worker process is gone ({exc!r}); "
                                     "counting again") from None
                raise
        answer = _unpack(body, frames)
        if "book_error" in answer:
            raise BookError(answer["book_error"])
        return _from_plain(method, answer["ok"]), float(answer["cpu"])

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is not None:
            # It died between calls (killed, out of memory): its book with it.
            code, self._child = self._child.returncode, None
            raise WorkerLost(f"the census worker process ended (exit status {code}); "
                             "counting again")
        if self._child is None:
            self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ckptd.lifecycle.census_worker", str(self.niceness),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=1 << 20)
            self.starts += 1
        return self._child

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    async def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(child.wait(), 5.0)

    async def close(self) -> None:
        await self._kill()


if __name__ == "__main__":
    main()
