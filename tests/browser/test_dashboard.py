"""The dashboard in a real (headless) Chromium against a real ``ckptd serve``: a job
with a dead and a degraded rank, and a checkpoint taken for a health reason.

Needs Debian's ``chromium`` at /usr/bin/chromium (``CKPTD_TEST_CHROMIUM`` names another)
and the ``playwright`` package (never ``playwright install``: it downloads its own
browser). Without chromium the tests skip, saying how to install it; in CI
(``CI`` set, as ``.ci/run`` runs them) they fail instead: nothing skips silently
there. Saves a screenshot to ``artifacts/dashboard.png``."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.hashing import chunk_spans
from tests.conftest import ServerProcess
from tests.integration.test_api import CHUNK, COLS, commit, manifest, put_manifest, tensor

CHROMIUM = Path(os.environ.get("CKPTD_TEST_CHROMIUM", "/usr/bin/chromium"))
NO_CHROMIUM = (f"needs Debian's chromium at {CHROMIUM}: sudo apt-get install chromium "
               "(or CKPTD_TEST_CHROMIUM=/path/to/chromium)")
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
# Heartbeats: a rank is dead after 3 missed. At 0.3 s the live ranks' beating thread,
# late by a second on a loaded machine, had them dead too.
INTERVAL = 1.0
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")


@pytest.fixture(autouse=True)
def _chromium() -> None:
    if not CHROMIUM.exists():
        if IN_CI:
            pytest.fail(f"CI runs the browser tests (.ci/run installs chromium), but it "
                        f"{NO_CHROMIUM}", pytrace=False)
        pytest.skip(NO_CHROMIUM)


def beat(client: httpx.Client, job: str, rank: int, world: int, **body: Any) -> dict[str, Any]:
    r = client.post(f"/v1/jobs/{job}/ranks/{rank}/heartbeat", json={"world_size": world, **body})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


@contextlib.contextmanager
def beating(url: str, headers: dict[str, str], job: str, world: int,
            bodies: dict[int, dict[str, Any]]) -> Iterator[None]:
    """Keeps the ranks of ``bodies`` heartbeating meanwhile, as live ranks do."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=10.0) as c:
            while not stop.is_set():
                for rank, body in bodies.items():
                    beat(c, job, rank, world, **body)
                stop.wait(INTERVAL / 3)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def put_step(client: httpx.Client, job: str, step: int, world: int, ranks: range | None = None,
             rows: int = 64, **meta: Any) -> None:
    """A step of two tensors split by rows over the ranks and one data-parallel
    replica, whose chunks each rank offers first and sends only when missing (the
    dedup the dashboard shows); committed unless only some ranks are given."""
    replica = os.urandom(rows * COLS * 4)
    for rank in ranks if ranks is not None else range(world):
        entries = [
            tensor(client, "model.w", rows=(rank * rows, (rank + 1) * rows),
                   global_rows=rows * world),
            tensor(client, "optim.m", rows=(rank * rows, (rank + 1) * rows),
                   global_rows=rows * world),
        ]
        embed = tensor(None, "model.embed", rows=(0, rows), global_rows=rows,
                       placement="replicated", data=replica)
        r = client.post("/v1/chunks/missing", json={"ids": embed.chunks, "claimer": f"r{rank}"})
        missing = set(r.json()["missing"])
        for i, (a, b) in enumerate(chunk_spans(len(replica), CHUNK)):
            if embed.chunks[i] in missing:
                assert client.put(f"/v1/chunks/{embed.chunks[i]}",
                                  content=replica[a:b]).status_code == 201
        m = manifest(job, step, rank, world, [*entries, embed])
        assert put_manifest(client, m).status_code == 201
    if ranks is None:
        r = commit(client, job, step, meta=meta)
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.errors = errors
            yield page
        finally:
            browser.close()


def wait_dead(client: httpx.Client, job: str, rank: int) -> None:
    def dead() -> bool:
        found = client.get(f"/v1/jobs/{job}/ranks").json()["ranks"]
        return any(r["rank"] == rank and r["state"] == "dead" for r in found)

    deadline = 150
    while not dead():
        deadline -= 1
        assert deadline > 0, "the silent rank never went dead"
        threading.Event().wait(0.1)


def ok(temp: float, mem: float) -> dict[str, Any]:
    """A healthy rank's probe readings (names as client/health/ sends them)."""
    return {"state": "ok", "reasons": [],
            "signals": {"gpu_temperature_c[0]": temp, "gpu_ecc_uncorrected_volatile[0]": 0,
                        "host_memory_percent": mem, "host_cpu_percent": 31.0}}


def test_dashboard_shows_dead_and_degraded_ranks_and_why(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store",
                        extra_args=["--heartbeat-interval", str(INTERVAL), "--dead-after", "3",
                                    "--peer-networks", "any"])  # made-up node names
    srv.start()
    job, world, other = "llama-7b-pretrain", 4, "resnet50-sweep"
    live: dict[int, dict[str, Any]] = {
        rank: {"step": 248, "held_step": 200, "peer_url": f"http://node-{rank}:8471",
               "rtt_ms": 0.9 + 0.2 * rank, "health": ok(64 + rank, 60.5 + rank)}
        for rank in range(3)
    }
    # Rank 1's probe sees ECC errors.
    live[1]["health"] = {"state": "degraded", "reasons": ["gpu ECC errors"],
                         "signals": {"gpu_temperature_c[0]": 87,
                                     "gpu_ecc_uncorrected_volatile[0]": 12,
                                     "host_memory_percent": 63.2}}
    others = {r: {"step": 24, "held_step": 20, "rtt_ms": 0.7, "health": ok(55, 40.0)}
              for r in range(2)}
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c, \
                beating(srv.url, {}, job, world, live), beating(srv.url, {}, other, 2, others):
            put_step(c, job, 100, world, reason="periodic")
            put_step(c, job, 200, world, reason="periodic")
            beat(c, job, 3, world, step=248, held_step=200, peer_url="http://node-3:8471")
            ask = c.post(f"/v1/jobs/{job}/snapshot-requests",
                         json={"rank": 1, "reason": "gpu ECC errors"}).json()
            assert ask == {"snapshot_at": 250, "reason": "gpu ECC errors", "accepted": True}
            put_step(c, job, 250, world, reason="health", requested_by=1)
            for body in live.values():
                body.update(step=302, held_step=250)
            put_step(c, job, 300, world, ranks=range(2))  # in flight: 2 of 4 ranks
            # Rank 3's last heartbeat: then it goes silent.
            beat(c, job, 3, world, step=301, held_step=250, peer_url="http://node-3:8471",
                 health=ok(70, 58.0))
            put_step(c, other, 10, 2, rows=16)
            put_step(c, other, 20, 2, rows=16, reason="manual")
            wait_dead(c, job, 3)
            with browser_page() as page:
                page.goto(srv.url + "/")
                page.wait_for_selector(f'article[data-job="{job}"] tr[data-state="dead"]',
                                       timeout=15_000)
                card = page.locator(f'article[data-job="{job}"]')
                dead = card.locator('tr[data-state="dead"]')
                assert dead.get_attribute("data-rank") == "3"
                assert "no heartbeat" in dead.inner_text()
                degraded = card.locator('tr[data-state="degraded"]')
                assert degraded.get_attribute("data-rank") == "1"
                assert "gpu ECC errors" in degraded.inner_text()
                assert "87 °C" in degraded.inner_text()
                assert card.locator('tr[data-state="alive"]').count() == 2
                step250 = card.locator('table.steps tr[data-step="250"]').inner_text()
                assert "health" in step250 and "by rank 1" in step250
                assert "pending 2/4" in card.locator(
                    'table.steps tr[data-step="300"]').inner_text()
                text = card.inner_text()
                assert "snapshot asked for at step 250 by rank 1" in text
                assert "rank 3 dead" in text
                assert "rank 0 dead" not in text  # the live ranks never went silent
                assert page.locator(f'article[data-job="{other}"]').count() == 1
                assert page.locator("#login").is_hidden()
                # Replicas offered the same chunks; one of each was sent.
                ratio = re.search(r"([0-9.]+)×", page.inner_text("#storage"))
                # (found by a probe: the dead rank, and ranks that left, were counted)
                assert "5 ranks reporting" in page.inner_text("#storage")
                assert ratio is not None and float(ratio.group(1)) > 2
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
                assert not page.errors, page.errors
    finally:
        srv.stop()


def test_dashboard_asks_for_the_token(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", token="dash-s3cret")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
            beat(c, "tokened-job", 0, 1, step=1)
        with browser_page() as page:
            page.goto(srv.url + "/")
            page.wait_for_selector("#login:not([hidden])", timeout=15_000)
            assert page.locator("article.job").count() == 0
            page.fill("#token", "wrong")
            page.click("#login-form button")
            page.wait_for_selector("#login-error:not([hidden])", timeout=15_000)
            assert "refused" in page.inner_text("#login-error")
            page.fill("#token", "dash-s3cret")
            page.click("#login-form button")
            page.wait_for_selector('article[data-job="tokened-job"]', timeout=15_000)
            assert page.locator("#login").is_hidden()
            # Kept for the tab only, and sent as a bearer header (not in the URL).
            stored = page.evaluate("sessionStorage.getItem('ckptd-token')")
            assert stored == "dash-s3cret"
            assert page.evaluate("localStorage.length") == 0
            assert "dash-s3cret" not in page.url
            errors = [e for e in page.errors if "401" not in e]
            assert not errors, errors
    finally:
        srv.stop()
