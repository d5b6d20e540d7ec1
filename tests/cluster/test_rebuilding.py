"""A replica that becomes a job's home says it is rebuilding the job's soft state
until every rank has beaten (or a dead window passed)."""

from __future__ import annotations

from ckptd.server.registry import Registry


def test_rebuilding_until_every_rank_beat_or_a_dead_window_passed() -> None:
    now = [100.0]
    registry = Registry(interval=1.0, dead_after=3, snapshot_lead=2, snapshot_min_interval=0,
                        snapshot_timeout=60, clock=lambda: now[0])
    assert not registry.rebuilding("j")  # never heard of: nothing to say
    registry.heartbeat("j", 0, world_size=3)
    assert registry.rebuilding("j")
    now[0] += 0.5
    registry.heartbeat("j", 2, world_size=3)
    assert registry.rebuilding("j")
    registry.heartbeat("j", 1, world_size=3)
    assert not registry.rebuilding("j")

    registry.heartbeat("k", 0, world_size=2)
    now[0] += 3.1  # a rank that never came: dead, not rebuilding
    assert not registry.rebuilding("k")
