"""ckptd.large_json: decoding in runs gives exactly json.loads, and documents a
server keeps are frozen out of the collector and still freed when dropped."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd import large_json

# Strings that look like the places a run may end ("},{", "],["), to tempt a
# wrong cut inside a string.
_TRICKY = st.sampled_from(["},{", "],[", '\\"},{"', "}, {", "]", "{", "é", ""])
_JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        _TRICKY | st.text(max_size=3), inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, indent=st.sampled_from([None, 0, 1, " , "]), batch=st.integers(1, 40),
       cut=st.integers(0, 10_000), insert=st.sampled_from([",", "]", "}", "[", "{", '"']))
def test_runs_decode_as_json_loads(value: Any, indent: int | str | None, batch: int, cut: int,
                                   insert: str) -> None:
    default = large_json.BATCH_CHARS
    large_json.BATCH_CHARS = batch  # runs even in short text
    try:
        _decodes_as_json_loads(value, indent, cut, insert)
    finally:
        large_json.BATCH_CHARS = default


def _decodes_as_json_loads(value: Any, indent: int | str | None, cut: int, insert: str) -> None:
    if isinstance(indent, str):  # whitespace on both sides of every separator
        text = json.dumps(value, separators=(indent, " : "), ensure_ascii=False)
    else:
        text = json.dumps(value, indent=indent, ensure_ascii=False)
    assert large_json.decode_piecewise(text) == json.loads(text)
    broken = text[:cut % (len(text) + 1)] + insert + text[cut % (len(text) + 1):]
    try:
        expected = json.loads(broken)
    except ValueError:
        with pytest.raises(ValueError):
            large_json.decode_piecewise(broken)
    else:
        assert large_json.decode_piecewise(broken) == expected


@pytest.mark.parametrize("text", [
    '[{"a":1} , {"a":NaN},{"a":2}]', '[[1],[Infinity],[2]]', '[{"a":1},{"a":2},]',
])
def test_runs_refuse_what_json_refuses(text: str) -> None:
    default = large_json.BATCH_CHARS
    large_json.BATCH_CHARS = 1
    try:
        with pytest.raises(ValueError):
            large_json.decode_piecewise(text)
    finally:
        large_json.BATCH_CHARS = default


def test_kept_documents_are_frozen_and_still_freed() -> None:
    enabled = gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with large_json.documents_kept_from_collector():
            assert not gc.isenabled()
            kept = [[i] for i in range(10_000)]
        assert gc.isenabled() == enabled
        frozen = gc.get_freeze_count()
        assert frozen >= before + 10_000  # never scanned again
        del kept
        assert gc.get_freeze_count() <= frozen - 10_000  # and freed when dropped
        refused: list[list[int]] = []
        frozen = gc.get_freeze_count()
        with pytest.raises(ValueError), large_json.documents_kept_from_collector():
            refused.extend([i] for i in range(10_000))
            raise ValueError("a bad document")
        assert gc.isenabled() == enabled
        assert gc.get_freeze_count() <= frozen  # nothing of a refused one is frozen
    finally:
        gc.unfreeze()


def test_cyclic_garbage_frozen_with_documents_is_collected_once_it_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(large_json, "COMPACT_FROM", 1)
    monkeypatch.setattr(large_json, "_compacted_at", 0)
    enabled = gc.isenabled()
    try:
        gc.unfreeze()
        with large_json.documents_kept_from_collector():
            pass
        live = gc.get_freeze_count()  # compacted at once: everything alive, no garbage
        for _ in range(8):
            with large_json.documents_kept_from_collector():
                kept = [[i] for i in range(1_000)]
                for _ in range(live * 7 // 10):  # cyclic garbage made meanwhile
                    cycle: list[object] = []
                    cycle.append(cycle)
                del cycle
            del kept
        # 5.6x the live objects in garbage cycles were frozen along the way: the
        # bound collected them whenever the frozen set reached 3x (without it: 6.6x).
        assert gc.get_freeze_count() < 3 * live
        assert gc.isenabled() == enabled
    finally:
        gc.unfreeze()


def test_garbage_made_while_the_collector_is_paused_is_not_frozen() -> None:
    """The soak's server: connections closed by the event loop while a manifest
    parsed (collector paused) were cyclic garbage, frozen with the manifest at the
    pause's end and kept for good, each with its upload buffer (~23 MiB in 5 min)."""
    enabled = gc.isenabled()
    try:
        gc.unfreeze()
        gc.collect()
        with large_json.documents_kept_from_collector():
            kept = [[i] for i in range(1_000)]
            for _ in range(1_000):
                cycle: list[object] = []
                cycle.append(cycle)
            del cycle
        gc.unfreeze()
        assert gc.collect() < 100  # (before: the 1,000 cycles, frozen with ``kept``)
        assert len(kept) == 1_000 and gc.isenabled() == enabled
    finally:
        gc.unfreeze()


def test_objects_frozen_alive_that_die_in_a_cycle_are_collected_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A freeze freezes every object alive then: a connection open at that moment
    and closed later is a cycle nobody scans. The frozen set is compacted every
    COMPACT_EVERY_S whatever its size (the soak's home replica: ~23 MiB of closed
    upload connections in 5 minutes)."""
    monkeypatch.setattr(large_json, "COMPACT_EVERY_S", 0.0)
    monkeypatch.setattr(large_json, "_compacted_time", 0.0)
    monkeypatch.setattr(large_json, "_compaction_s", 0.0)
    monkeypatch.setattr(large_json, "_compacted_at", 0)
    try:
        gc.unfreeze()
        # Many, so that what other threads of a busy test process freeze meanwhile
        # (a hundred objects or so, seen in a full run) cannot hide the compaction.
        connections = [[] for _ in range(20_000)]
        for c in connections:
            c.append(c)  # alive, in a cycle (a protocol and its transport)
        with large_json.documents_kept_from_collector():
            pass
        del connections, c  # closed after the freeze: frozen garbage
        before = gc.get_freeze_count()
        monkeypatch.setattr(large_json, "_compacted_time", 0.0)  # the interval passed
        monkeypatch.setattr(large_json, "_compaction_s", 0.0)
        with large_json.documents_kept_from_collector():
            pass
        assert gc.get_freeze_count() <= before - 19_000  # (a few new ones frozen with it)
    finally:
        gc.unfreeze()


def test_small_manifests_held_by_a_server_are_frozen_in_batches() -> None:
    """A server's cache of small manifests (built with the collector running) is
    frozen a batch at a time, so that what the collector's full passes scan stays
    about one batch: unfrozen, 64 ranks of 2,000 tensors made each pass 0.4 s, and
    a full cache (a million entries) seconds. What it scans is what
    ``gc.get_objects()`` lists (the frozen are not among them)."""
    import asyncio

    from ckptd.documents import FREEZE_EVERY_ENTRIES, KEEP_FROZEN_FROM, ParsedManifests
    from ckptd.testing.manifests import many_tensor_manifests

    manifests, _ = many_tensor_manifests("j", 1, 40, 2_000)
    bodies = [m.canonical() for m in manifests]
    del manifests
    assert len(bodies[0]) < KEEP_FROZEN_FROM
    cache = ParsedManifests(1_000_000)
    cache.kept_from_collector = True

    async def parse_all() -> None:
        for rank, body in enumerate(bodies):
            await cache.parse(f"jobs/j/steps/1/ranks/{rank}.json", body)

    try:
        gc.unfreeze()
        gc.collect()
        scanned = len(gc.get_objects())
        asyncio.run(parse_all())
        grown = len(gc.get_objects()) - scanned
        # 80,000 entries held, about 9 objects each; at most a batch of them scanned
        assert gc.get_freeze_count() > 400_000, gc.get_freeze_count()
        assert grown < 12 * FREEZE_EVERY_ENTRIES, grown
    finally:
        gc.unfreeze()


def test_a_large_manifest_is_scanned_in_pieces_as_it_is_built() -> None:
    """Built with the collector paused, a large manifest was scanned once at the
    pause's end, all of it (0.15 s with the GIL held for 100,000 tensors); its
    pieces are now scanned as they are decoded and validated, and the end scans
    the last piece only. ``gc.get_count()[0]``: what the end's scan would read."""
    from ckptd.format import RankManifest
    from ckptd.testing.manifests import many_tensor_manifests

    (manifest,), _ = many_tensor_manifests("j", 1, 1, 20_000)
    body = manifest.canonical()
    del manifest
    try:
        with large_json.documents_kept_from_collector():
            parsed = RankManifest.parse(body)
            young = gc.get_count()[0]
        assert len(parsed.entries) == 20_000
        assert young < 20_000, young  # (a slice at most; the whole manifest: 182,000)
    finally:
        gc.unfreeze()


def test_small_manifests_are_parsed_as_any_object_and_never_frozen() -> None:
    import asyncio

    from ckptd.documents import KEEP_FROZEN_FROM, ParsedManifests
    from ckptd.testing.manifests import demo_step

    manifest, _ = demo_step("j", 1, 1)[0]
    data = manifest.canonical()
    assert len(data) < KEEP_FROZEN_FROM
    cache = ParsedManifests(1000)
    cache.kept_from_collector = True
    try:
        gc.unfreeze()
        asyncio.run(cache.parse("jobs/j/steps/1/ranks/0.json", data))
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_process_first_freeze_compacts_nothing() -> None:
    """The periodic compaction counts from the process's start, not from the
    monotonic clock's zero (the host's boot): a server's first large manifest set
    one off, a full collection of everything it had built (0.25 s with the GIL
    held, /healthz unanswered meanwhile). Cyclic garbage in the oldest generation
    shows it: only a full collection frees it before the first freeze. Run in a
    fresh interpreter (this one's state is shared)."""
    script = (
        "import gc\n"
        "from ckptd import large_json\n"
        "gc.disable()\n"
        "garbage = [[] for _ in range(20_000)]\n"
        "for c in garbage: c.append(c)\n"
        "gc.collect()\n"  # (promoted to the oldest generation, alive)
        "del garbage, c\n"
        "with large_json.documents_kept_from_collector(): pass\n"
        "print(gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) >= 20_000, out  # frozen as it was, no full collection


def test_the_frozen_set_is_counted_only_when_it_may_have_grown_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counting the frozen set walks all of it (0.5 s with the GIL held for a full
    cache of manifests): a batch of small manifests is frozen every few seconds,
    and each freeze counted it. Now only what was frozen since the last count is
    added up, and the set counted once that sum could reach the bound."""
    counted = []
    real = gc.get_freeze_count
    monkeypatch.setattr(large_json, "COMPACT_EVERY_S", 3600.0)
    monkeypatch.setattr(large_json, "_compacted_time", time.monotonic())
    monkeypatch.setattr(large_json, "_compacted_at", 0)
    monkeypatch.setattr(large_json, "_counted", 0, raising=False)
    monkeypatch.setattr(large_json, "_frozen_since", 0, raising=False)
    monkeypatch.setattr(large_json.gc, "get_freeze_count", lambda: counted.append(1) or real())
    try:
        gc.unfreeze()
        for _ in range(5):
            large_json.freeze_what_survives()
        assert counted == []  # (a few thousand objects each time: far from 4,000,000)
        monkeypatch.setattr(large_json, "COMPACT_FROM", 1)
        large_json.freeze_what_survives()
        assert counted == [1, 1]  # past the bound: counted, compacted (and counted)
    finally:
        monkeypatch.undo()
        gc.unfreeze()
