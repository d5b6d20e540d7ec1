"""Launches of one job as its heartbeats name them (``HeartbeatRequest.launch``):
two launches whose ranks both keep beating after the newer one's first beat are
two jobs under one name, or a rank of an old launch that still runs
(docs/failover.md, "Two jobs with one name").

A restart is no conflict: torchrun kills the old launch's workers before it starts
the new ones (a replaced node's too), so none of the old launch's beats comes after
the new launch's first, though the server has not yet declared its ranks dead
(``dead_after``). Only a beat of the older launch after that, while the newer one
beats too, tells two live launches apart from a restart. Detection only: both sides
are told in their heartbeat replies, and nothing is refused.

Soft state kept per job under the registry's lock; no lock of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

# Launches of one job kept at most (the least recently heard of goes first).
KEEP = 8
# Ranks and hosts a warning names at most.
NAMED = 8


@dataclass(slots=True)
class _Launch:
    first: float  # the registry's clock at its first beat here
    last: float
    gap: float = 0.0  # the last time between two beats of one of its ranks
    ranks: dict[int, tuple[str | None, float]] = field(default_factory=dict)  # host, seen


def _ranks(ranks: list[int]) -> str:
    spans: list[str] = []
    for r in sorted(ranks):
        if spans and spans[-1].split("-")[-1] == str(r - 1):
            spans[-1] = f"{spans[-1].split('-')[0]}-{r}"
        else:
            spans.append(str(r))
    more = f" ({len(ranks)} in all)" if len(spans) > NAMED else ""
    return ", ".join(spans[:NAMED]) + more


def _short(launch: str) -> str:
    return launch if len(launch) <= 48 else launch[:45] + "..."


class JobLaunches:
    """The launches one job's heartbeats named, and the conflicts already said."""

    __slots__ = ("_launches", "_said")

    def __init__(self) -> None:
        self._launches: dict[str, _Launch] = {}
        self._said: set[frozenset[str]] = set()  # pairs logged (once per conflict)

    def beat(self, job: str, launch: str, rank: int, host: str | None, now: float, *,
             interval: float, forget_after: float) -> tuple[str | None, list[str]]:
        """Records a beat of ``rank`` of ``launch`` from ``host``. Returns the warning
        for its reply (None: no other launch is live at once) and the conflicts not
        said before, one line each (the caller logs them and records an event)."""
        for name in [n for n, seen in self._launches.items()
                     if n != launch and now - seen.last > forget_after]:
            self._forget(name)
        seen = self._launches.get(launch)
        if seen is None:
            if len(self._launches) >= KEEP:
                self._forget(min(self._launches, key=lambda n: self._launches[n].last))
            seen = self._launches[launch] = _Launch(first=now, last=now)
        before = seen.ranks.get(rank)
        if before is not None:
            seen.gap = now - before[1]
        seen.last = now
        seen.ranks[rank] = (host, now)
        others = sorted((n for n, other in self._launches.items()
                         if n != launch and self._both_live(seen, other, now, interval)),
                        key=lambda n: -self._launches[n].last)
        if not others:
            return None, []
        news: list[str] = []
        for name in others:
            pair = frozenset((launch, name))
            if pair not in self._said:
                self._said.add(pair)
                news.append(f"job {job} has live ranks of two launches at once: "
                            f"{self._where(launch, now, interval)}; and "
                            f"{self._where(name, now, interval)}: two jobs with one name, "
                            "or a rank of an old launch still running")
        more = f" (and {len(others) - 1} more launches)" if len(others) > 1 else ""
        reply = (f"job {job} has live ranks of two launches at once (this one, "
                 f"{_short(launch)}, and another, {self._where(others[0], now, interval)}"
                 f"{more}): two jobs with one name? give one of them another job name "
                 "(Checkpointer job=); or a rank of an old launch still running (stop it)")
        return reply, news

    @staticmethod
    def _both_live(a: _Launch, b: _Launch, now: float, interval: float) -> bool:
        # Each heard of within about two of its intervals (its own, when its ranks
        # beat less often than the server's interval), and the older one heard of
        # after the newer one's first beat: a restarted launch's old ranks are not.
        older, newer = (a, b) if a.first <= b.first else (b, a)
        return (older.last > newer.first
                and all(now - x.last <= 2 * max(interval, x.gap) for x in (a, b)))

    def _where(self, launch: str, now: float, interval: float) -> str:
        seen = self._launches[launch]
        live = {r: host for r, (host, at) in seen.ranks.items()
                if now - at <= 2 * max(interval, seen.gap)}
        hosts = sorted({h for h in live.values() if h})
        named = ", ".join(hosts[:NAMED]) + (f" ({len(hosts)} in all)" if len(hosts) > NAMED
                                             else "")
        return (f"launch {_short(launch)} at {named or 'an unknown address'}, "
                f"ranks {_ranks(list(live))}")

    def _forget(self, launch: str) -> None:
        self._launches.pop(launch, None)
        self._said = {pair for pair in self._said if launch not in pair}
