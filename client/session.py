"""What one checkpointer's parts share: its config, the transport on its
background event loop, the staging pool, the lock that keeps a save's staging and
a restore's reads of the pool apart, and whether its token may write the job."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptd import knobs
from ckptd.errors import CkptdError, Forbidden, InvalidRequest

from .config import CheckpointerConfig
from .failures import wrap_error
from .loop import EventLoopThread
from .staging.pool import StagingPool
from .transport import Transport, open_transport

log = logging.getLogger("ckptd.client.checkpointer")

T = TypeVar("T")


class Session:
    """The live parts of one checkpointer (``timeout`` may be changed while open)."""

    def __init__(self, config: CheckpointerConfig) -> None:
        self.config = config
        self.timeout = config.timeout
        self.transport: Transport = open_transport(config.url, config.token, job=config.job)
        try:
            self.staging = StagingPool(config.job, config.rank, root=config.shm_dir,
                                       budget=config.staging_budget)
        except BaseException:
            asyncio.run(self.transport.close())
            raise
        self.loop = EventLoopThread(f"ckptd-{config.job}-{config.rank}")
        # No save stages into the pool while a restore may read it.
        self.lock = threading.Lock()
        self.closed = False
        # The server's refusal of a write by this token (it may only read the job:
        # this checkpointer restores, sends no heartbeats and refuses saves), or None.
        self.read_only: str | None = None

    def reach(self) -> None:
        """Raises, typed and naming the server's URL, when an HTTP server cannot be
        reached or refuses this checkpointer's token (``reach.py``), within
        ``CKPTD_SERVER_WAIT`` seconds (one connect timeout when nothing answers).
        A token that may read the job but not write it is said in one warning, and
        kept in ``read_only``."""
        from .transport import HttpTransport, LocalTransport

        if isinstance(self.transport, LocalTransport):  # a store read in this process
            store = self.transport.repository.store
            self.loop.run(store.check_open(), 2 * knobs.connect_timeout() + 30.0)
            return
        if not isinstance(self.transport, HttpTransport):
            return
        from .reach import reach

        within = knobs.server_wait()
        bound = within + 3 * self.transport.session.connect_timeout + 10.0
        refused = self.loop.run(reach(self.transport, self.config.job, within), bound)
        if refused is not None:
            self.read_only = refused
            c = self.config
            log.warning("%s/%d: the token given may read job %r but not write it (%s): this "
                        "Checkpointer can restore, but its saves will be refused; saving "
                        "needs a token of role write (ckptd token create --job %s --role "
                        "write)", c.job, c.rank, c.job, refused, c.job)

    def check_may_write(self, step: int) -> None:
        """Raises ``Forbidden`` in a line when this checkpointer's token may only read."""
        if self.read_only is not None:
            c = self.config
            raise Forbidden(f"save of {c.job} step {step}: the token given may read job "
                            f"{c.job!r} but not write it, so this Checkpointer only restores; "
                            f"to save, pass a token of role write on the job (ckptd token "
                            f"create --job {c.job} --role write) as token= or CKPTD_TOKEN",
                            job=c.job, needs="write")

    def check_open(self) -> None:
        if self.closed:
            raise InvalidRequest("this Checkpointer is closed")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None,
             what: str = "request", kind: type[CkptdError] = CkptdError) -> T:
        """Runs ``coro`` on the background loop; errors come out typed (any that is
        not ckptd's as a ``kind`` saying that ``what`` failed, its cause kept)."""
        try:
            return self.loop.run(coro, timeout)
        except CkptdError:
            raise
        except Exception as exc:
            raise wrap_error(exc, what, kind) from exc

    def close(self) -> None:
        """Ends the loop's work still under way (what is quick finishes, the rest is
        cancelled), closes the transport, stops the loop, removes the staging pool."""
        try:
            self.loop.run(_settle_tasks(0.5), 10.0)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.debug("%s/%d: settling the loop's tasks: %s", self.config.job,
                      self.config.rank, exc)
        try:
            self.loop.run(self.transport.close(), 10.0)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("%s/%d: closing the transport failed: %s", self.config.job,
                        self.config.rank, exc)
        self.loop.stop()
        self.staging.close()


async def _settle_tasks(grace: float) -> None:
    """Lets the loop's other tasks end within ``grace`` seconds, then cancels and
    awaits the rest: a task still pending when the loop stops is destroyed pending
    (asyncio says so at exit: "Task was destroyed but it is pending!"), and the
    answer it waited for is never retrieved."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5.0)
