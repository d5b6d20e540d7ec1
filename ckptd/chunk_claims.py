"""Short leases on chunk ids that a caller promised to send, so that two ranks
uploading the same chunk through one server send it once (soft state of a
repository; DESIGN.md, "Deduplication")."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

# Leases held before the expired ones are dropped the first time.
LEASES_PURGE_FROM = 10_000


class ChunkClaims:
    """Short leases on chunk ids a caller promised to send (soft state).

    A missing-chunks call checks the store, then takes leases: two steps, with
    awaits between them. A replica that finishes a chunk in that gap releases its
    lease before the late caller looks, so the late caller would see the chunk
    absent and unclaimed and send it again. Each call therefore opens a window
    (``begin``) before it checks the store, and ``split`` treats an id stored
    since its window opened as present. Stored ids are remembered only while a
    window older than them is still open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[str, float]] = {}
        self._purge_at = LEASES_PURGE_FROM
        self._seq = 0
        self._open: dict[int, int] = {}  # window start -> calls open since then
        self._stored: dict[str, int] = {}  # id -> seq at which it was stored
        self._stored_order: deque[tuple[int, str]] = deque()  # the same, oldest first

    def begin(self) -> int:
        with self._lock:
            self._open[self._seq] = self._open.get(self._seq, 0) + 1
            return self._seq

    def split(
        self, ids: Iterable[str], claimer: str, lease: float, since: int
    ) -> tuple[list[str], list[str]]:
        """(ids now leased to ``claimer``, ids another claimer holds). Ids stored
        after window ``since`` opened are in neither."""
        now = time.monotonic()
        mine: list[str] = []
        theirs: list[str] = []
        with self._lock:
            for cid in ids:
                if self._stored.get(cid, -1) >= since:
                    continue  # stored while the caller was checking the store
                held = self._leases.get(cid)
                if held is None or held[1] <= now or held[0] == claimer:
                    self._leases[cid] = (claimer, now + lease)
                    mine.append(cid)
                else:
                    theirs.append(cid)
            if len(self._leases) > self._purge_at:
                # Leases never released (a rank that died, a chunk it did not send)
                # expire here now and then: twice as many as the last purge left.
                self._leases = {k: v for k, v in self._leases.items() if v[1] > now}
                self._purge_at = max(LEASES_PURGE_FROM, 2 * len(self._leases))
        return mine, theirs

    def end(self, since: int) -> None:
        with self._lock:
            left = self._open.pop(since) - 1
            if left:
                self._open[since] = left
            oldest = min(self._open, default=self._seq + 1)
            # Forget what no open window can have missed.
            while self._stored_order and self._stored_order[0][0] < oldest:
                seq, cid = self._stored_order.popleft()
                if self._stored.get(cid) == seq:
                    del self._stored[cid]

    def release(self, cid: str, *, stored: bool) -> None:
        with self._lock:
            self._leases.pop(cid, None)
            if stored and self._open:
                self._stored[cid] = self._seq
                self._stored_order.append((self._seq, cid))
                self._seq += 1
