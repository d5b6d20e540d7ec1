"""Sizes on the dashboard read as ``ckptd ls`` prints them (``human_bytes``), in
headless Chromium against a real ``ckptd serve``: one step, one size, one text."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ckptd.format import TensorEntry
from ckptd.hashing import chunk_spans
from ckptd.knobs import human_bytes
from tests.browser.test_dashboard import _chromium, browser_page  # noqa: F401
from tests.conftest import ServerProcess
from tests.integration.test_api import CHUNK, commit, manifest, put_chunk, put_manifest

pytestmark = pytest.mark.slow
JOB = "sizes-job"
# Ties (x.25, x.75 of a unit: Python rounds them to even), units' edges, huge ones.
SIZES = [0, 1, 1023, 1024, 1536, 5000, 11008, 16640, 1310720, 10 * 2**20 - 1,
         3 * 2**30 + 2**28, 2**40, 2**40 + 2**38, 2**50, 2**62 + 2**61, 123456789]


def local_entry(client: httpx.Client, name: str, nbytes: int) -> TensorEntry:
    """A rank-local float32 tensor of ``nbytes`` bytes, its chunks uploaded."""
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    chunks = [put_chunk(client, data[a:b]) for a, b in chunk_spans(nbytes, CHUNK)]
    return TensorEntry(name=name, dtype="float32", placement="local",
                       global_shape=[nbytes // 4], offsets=[0], shape=[nbytes // 4],
                       nbytes=nbytes, chunks=chunks)


def test_sizes_read_as_ckptd_ls_prints_them(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            # 16640 bytes = 16.25 KiB: ckptd ls (Python) says 16.2, a tie to even
            m = manifest(JOB, 1, 0, 1, [local_entry(c, "opt", 16640)])
            assert put_manifest(c, m).status_code == 201
            assert commit(c, JOB, 1).json()["state"] == "committed"
        with browser_page() as page:
            page.goto(srv.url + "/")
            card = page.locator(f'article[data-job="{JOB}"]')
            row = card.locator('table.steps tr[data-step="1"]')
            row.wait_for(timeout=15_000)
            # (found by a probe: the dashboard said 16.3 KiB, ckptd ls 16.2 KiB)
            assert human_bytes(16640) == "16.2 KiB"
            assert "16.2 KiB" in row.inner_text()
            assert "16.2 KiB" in (card.locator(".timeline .tick").first.get_attribute("title")
                                  or "")
            assert page.evaluate(
                "(ns) => window.ckptdFormat ? ns.map(window.ckptdFormat.bytes) : null",
                SIZES) == [human_bytes(n) for n in SIZES]
            assert not page.errors, page.errors
    finally:
        srv.stop()
