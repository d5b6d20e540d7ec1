"""What one checkpointer's parts share: its config, the transport on its
background event loop, the staging pool, and the lock that keeps a save's
staging and a restore's reads of the pool apart."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptd.errors import CkptdError, InvalidRequest

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

    def check_open(self) -> None:
        if self.closed:
            raise InvalidRequest("this Checkpointer is closed")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs ``coro`` on the background loop; errors come out typed."""
        try:
            return self.loop.run(coro, timeout)
        except CkptdError:
            raise
        except Exception as exc:
            raise wrap_error(exc, "request") from exc

    def close(self) -> None:
        """Closes the transport, stops the loop, removes the staging pool."""
        try:
            self.loop.run(self.transport.close(), 10.0)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("%s/%d: closing the transport failed: %s", self.config.job,
                        self.config.rank, exc)
        self.loop.stop()
        self.staging.close()
