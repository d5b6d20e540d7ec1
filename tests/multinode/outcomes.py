"""What a disturbed multi-node job must show against an undisturbed run of the
same steps: every rank's weights, optimizer state, generator and learning rate
bitwise equal; each restore the committed bytes exactly; each committed step
written by one launch only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.multinode.hosts import Host
from tests.multinode.jobs import Job, Replica

JOB = "llm-7b"  # the README loop's job


@dataclass(frozen=True)
class Outcome:
    """A finished job: each rank's result (by rank) and every event it marked."""

    results: list[dict[str, Any]]
    events: list[dict[str, Any]]
    store_at_100: Path | None = None

    @classmethod
    def of(cls, job: Job, results: list[dict[str, Any]],
           store_at_100: Path | None = None) -> Outcome:
        return cls(results, job.events(), store_at_100)

    def saved(self, step: int) -> str:
        """The digest of model and optimizer that the save of ``step`` was given."""
        found = {e["digest"] for e in self.events if e["event"] == "save" and e["step"] == step}
        assert len(found) == 1, f"step {step} saved as {found or 'nothing'}"
        return str(found.pop())


def assert_bitwise(run: list[dict[str, Any]], clean: list[dict[str, Any]],
                   ranks: range | None = None) -> None:
    """Each rank ended exactly where the undisturbed run's rank did."""
    ranks = ranks if ranks is not None else range(len(clean))
    assert len(run) == len(ranks), [r.get("host") for r in run]
    for r in ranks:
        got, want = run[r], clean[r]
        assert "error" not in got, got
        assert got["digest"] == want["digest"], f"rank {r}: model/optimizer differ"
        assert got["rng"] == want["rng"], f"rank {r}: its generator differs"
        assert got["last_lr"] == want["last_lr"], f"rank {r}: {got['last_lr']}"


def restores_after(events: list[dict[str, Any]], t: float) -> list[dict[str, Any]]:
    """The restores that began after ``t``, by rank."""
    found = sorted((e for e in events if e["event"] == "restored" and e["began"] > t),
                   key=lambda e: e["rank"])
    return found


def launches_by_step(replica: Replica, via: Host, world: int) -> dict[int, set[str | None]]:
    """Each committed step's launches, as its rank manifests name them."""
    steps = replica.get(f"/v1/jobs/{JOB}/steps", via=via)["steps"]
    found: dict[int, set[str | None]] = {}
    for summary in steps:
        if not summary["committed"]:
            continue
        step = summary["step"]
        size = summary["world_size"] or world
        found[step] = {replica.get(f"/v1/jobs/{JOB}/steps/{step}/ranks/{r}", via=via)
                       .get("meta", {}).get("incarnation") for r in range(size)}
    return found


def assert_one_launch_per_step(replica: Replica, via: Host, world: int) -> dict[int, str]:
    """No committed step mixes manifests of two launches, nor has one of no known
    launch; the launch of each step."""
    launches = launches_by_step(replica, via, world)
    assert launches, "nothing committed"
    for step, names in launches.items():
        assert len(names) == 1 and None not in names, f"step {step} written by {names}"
    return {step: next(iter(names)) for step, names in launches.items()}  # type: ignore[misc]


def expect_steps(replica: Replica, via: Host, launches: dict[int, str], expected: set[int]
                 ) -> None:
    """The committed steps are ``expected``, and any other is a snapshot the health
    probe asked for (its commit record says so): on a loaded machine a slow step may
    ask for one, which commits like any other. The record, not the worker's marks:
    ``Checkpointer.step()`` takes that snapshot without going through ``save()``."""
    assert expected <= set(launches), sorted(launches)
    reasons = {step: replica.get(f"/v1/jobs/{JOB}/steps/{step}", via=via)["meta"].get("reason")
               for step in set(launches) - expected}
    assert all(reason == "health" for reason in reasons.values()), reasons
