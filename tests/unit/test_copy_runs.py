"""Delivery's copies (``fetch.copy_runs``): chunks that follow each other both in
the target and where they lie become one copy, runs are cut for the threads, and
making the copies gives the same bytes as copying chunk by chunk."""

from __future__ import annotations

import ctypes
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.client.restore.fetch import COPY_PIECE_MIN, copy_runs


def test_neighbours_in_both_places_merge_and_others_do_not() -> None:
    spans = [(1000, 5000, 10), (1010, 5010, 10), (1020, 9000, 10), (1030, 9010, 5)]
    assert copy_runs(spans, 1) == [(1000, 5000, 20), (1020, 9000, 15)]
    assert copy_runs(list(reversed(spans)), 4) == [(1000, 5000, 20), (1020, 9000, 15)]


def test_a_long_run_is_cut_for_the_threads() -> None:
    n = 4 * COPY_PIECE_MIN
    runs = copy_runs([(0, 1 << 40, n // 2), (n // 2, (1 << 40) + n // 2, n // 2)], 4)
    assert runs == [(k * COPY_PIECE_MIN, (1 << 40) + k * COPY_PIECE_MIN, COPY_PIECE_MIN)
                    for k in range(4)]
    assert copy_runs([(0, 1 << 40, 100)], 8) == [(0, 1 << 40, 100)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=40), seed=st.integers(0, 2**16),
       parts=st.integers(1, 8))
def test_the_runs_copy_what_the_chunks_would(sizes: list[int], seed: int, parts: int) -> None:
    rng = random.Random(seed)
    total = sum(sizes)
    src = np.frombuffer(rng.randbytes(total * 2), dtype=np.uint8).copy()
    dst = np.zeros(total, dtype=np.uint8)
    expected = np.zeros(total, dtype=np.uint8)
    spans = []
    at = 0
    # Each chunk from somewhere in src: mostly right after the previous one (a
    # tensor's chunks in a pool), sometimes elsewhere.
    where = rng.randrange(total)
    for n in sizes:
        if rng.random() < 0.3:
            where = rng.randrange(total)
        expected[at : at + n] = src[where : where + n]
        spans.append((dst.ctypes.data + at, src.ctypes.data + where, n))
        at, where = at + n, where + n
    rng.shuffle(spans)
    runs = copy_runs(spans, parts)
    assert sum(n for _, _, n in runs) == total
    for d, s, n in runs:
        ctypes.memmove(d, s, n)
    assert np.array_equal(dst, expected)
