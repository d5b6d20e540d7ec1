"""The budget of chunk answers held in memory: a store whose chunks are not files
here (S3) gives each chunk read whole, and a slow reader holds it until it has
read it all; every such answer together holds at most ``Settings.egress_budget``."""

from __future__ import annotations

import threading

from fastapi import Request

from ckptd.errors import Unavailable
from ckptd.server.bodies import wait_for_room


class EgressHold:
    """Bytes one answer holds against the budget; ``release`` is idempotent (the
    answer releases once sent, a finalizer if it never was)."""

    def __init__(self, budget: EgressBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def resize(self, nbytes: int) -> None:
        """The chunk read is ``nbytes`` long: counted as such, room or not (it is
        in memory already), and the next reservations expect chunks as large."""
        self._budget.adjust(nbytes - self.nbytes, seen=nbytes)
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._budget.adjust(-self.nbytes)
            self.nbytes = 0


class EgressBudget:
    """Bytes of chunk answers held at once. A read reserves the largest chunk seen
    so far (its size is known only once read) before it asks the store, waits up
    to ``wait_s`` while the budget is spent, then is refused (503 with
    Retry-After: readers retry); once read, it counts its real size. One answer
    larger than the budget may go alone."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        # The largest chunk read so far; None before the first: that one reserves
        # the whole budget, so a first wave of readers cannot all pass on a guess.
        self.expected: int | None = None
        self._lock = threading.Lock()

    def adjust(self, delta: int, *, seen: int = 0) -> None:
        with self._lock:
            self.held += delta
            if seen:
                self.expected = max(self.expected or 0, seen)

    def try_reserve(self, nbytes: int | None = None) -> EgressHold | None:
        """A reservation of ``nbytes`` (default: the largest chunk seen), or None
        while the budget is spent."""
        with self._lock:
            want = nbytes if nbytes is not None else (
                self.capacity if self.expected is None else self.expected)
            if self.held + want <= self.capacity or self.held == 0:
                self.held += want
                return EgressHold(self, want)
            return None

    async def reserve(self) -> EgressHold:
        holds: list[EgressHold] = []

        def room() -> bool:
            hold = self.try_reserve()
            if hold is not None:
                holds.append(hold)
            return hold is not None

        await wait_for_room(room, self.wait_s, lambda: Unavailable(
            f"the server holds {self.held} bytes of chunk answers (its budget is "
            f"{self.capacity}); try again shortly", retry_after_s=1,
        ))
        return holds[0]


def egress_budget(request: Request) -> EgressBudget:
    """The budget of this application's chunk answers (``Settings.egress_budget``)."""
    budget = getattr(request.app.state, "egress", None)
    if not isinstance(budget, EgressBudget):
        settings = getattr(request.app.state, "settings", None)
        budget = EgressBudget(int(getattr(settings, "egress_budget", 256 << 20)),
                              float(getattr(settings, "egress_wait", 10.0)))
        request.app.state.egress = budget
    return budget
