"""A save's handle: when the caller may touch its tensors again, and what came of
the snapshot (``SaveHandle``)."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable

from ckptd.errors import CkptdError, InvalidRequest, SnapshotSkipped, Timeout

from ..cuda import CopyDone
from ..failures import wrap_error
from .snapshot import SaveResult


def _limit(timeout: float | None, what: str) -> float | None:
    """``timeout`` as a wait takes it: None for no limit (``math.inf`` too, which a
    lock cannot wait); a caller's mistake (negative, NaN, not a number) refused."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or math.isnan(timeout) or timeout < 0):
        raise InvalidRequest(f"{what}(timeout=) takes seconds, 0 or more (None: no limit), "
                             f"not {timeout!r}")
    return None if timeout >= threading.TIMEOUT_MAX else timeout


class SaveHandle:
    """A snapshot in flight.

    When the caller may change its tensors again: on the CPU, as soon as ``save()``
    returns (the staging copy is done by then); with CUDA tensors, once ``staged()``
    returned, or, for changes made by kernels on the current stream, once
    ``block_current_stream()`` was called (``save()`` does that by default).
    ``wait()`` gives the result once the step is uploaded, or raises the typed
    error that stopped it.

    ``skipped``: the save was skipped by ``on_busy="skip"`` (nothing staged);
    ``waited_seconds``: how long ``save()`` waited for the snapshot before it
    (``on_busy="wait"``); ``stall_seconds``: how long ``save()`` blocked in all;
    ``pieces``: how many pieces a staging budget split the state into."""

    def __init__(
        self,
        step: int,
        future: concurrent.futures.Future[SaveResult] | None,
        *,
        skipped: bool = False,
        copy_done: CopyDone | None = None,
        stall_seconds: float = 0.0,
        waited_seconds: float = 0.0,
        pieces: int = 1,
        on_failure_seen: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.step = step
        self.skipped = skipped
        self.stall_seconds = stall_seconds
        self.waited_seconds = waited_seconds
        self.pieces = pieces
        self._future = future
        self._copy_done = copy_done
        self._on_failure_seen = on_failure_seen

    def __repr__(self) -> str:
        what = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"<SaveHandle step={self.step} {what}>"

    @property
    def future(self) -> concurrent.futures.Future[SaveResult] | None:
        """The snapshot's future (None when skipped)."""
        return self._future

    def done(self) -> bool:
        """True once the snapshot finished (or failed, or was skipped)."""
        return self._future is None or self._future.done()

    @property
    def waited(self) -> bool:
        """True when ``save()`` waited for the snapshot in flight before it."""
        return self.waited_seconds > 0.0

    def staged(self, timeout: float | None = None) -> None:
        """Returns once the training loop may change its tensors again.

        On the CPU the copy is finished when ``save()`` returns, so this returns at
        once. With CUDA tensors the copies run on a side stream: this blocks the
        host until they are done (``Timeout`` after ``timeout`` seconds). Call it
        before changing the tensors, e.g. before ``optimizer.step()``."""
        timeout = _limit(timeout, "staged")
        if self._copy_done is not None:
            self._copy_done.synchronize(timeout)

    def block_current_stream(self) -> None:
        """Makes each device's current CUDA stream wait for the staging copies,
        without blocking the host: kernels queued on it afterwards (an optimizer
        step) run after the copies. Changes made from other streams or from the
        host still need ``staged()``. A no-op on the CPU."""
        if self._copy_done is not None:
            self._copy_done.block_streams()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Waits for the upload and commit; the ``SaveResult``.

        Raises ``SnapshotSkipped`` for a skipped save, ``Timeout`` when ``timeout``
        seconds pass first (the snapshot goes on), or the typed ``CkptdError`` that
        failed the snapshot."""
        timeout = _limit(timeout, "wait")
        if self._future is None:
            raise SnapshotSkipped(
                f"save of step {self.step} was skipped: a snapshot was in flight", step=self.step
            )
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise Timeout(
                f"snapshot of step {self.step} still running after {timeout} s", step=self.step
            ) from None
        except concurrent.futures.CancelledError:
            raise CkptdError(
                f"snapshot of step {self.step} was cancelled", step=self.step
            ) from None
        except CkptdError as exc:
            if self._on_failure_seen is not None:
                self._on_failure_seen(exc)  # seen here: the next save() need not raise it
            raise
        except Exception as exc:
            raise wrap_error(exc, f"snapshot of step {self.step}") from exc
