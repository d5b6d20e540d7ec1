"""Ranks that left and the events the server sends, in headless Chromium against a
real ``ckptd serve``: each in words, none as its raw kind; and every event kind the
server's code adds has its words in the page's script."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.browser.test_dashboard import _chromium, beat, browser_page, put_step  # noqa: F401
from tests.conftest import ServerProcess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
JOB = "events-job"


def server_event_kinds() -> set[str]:
    """The kinds the server's code gives its events: ``Event(when, "kind", ...)`` and
    ``add_event(job, "kind", ...)``."""
    kinds: set[str] = set()
    for path in (ROOT / "server").rglob("*.py"):
        text = path.read_text("utf-8")
        kinds |= set(re.findall(r'\bEvent\(\s*[^,()]+(?:\([^()]*\))?,\s*"(\w+)"', text))
        kinds |= set(re.findall(r'\badd_event\(\s*\w+,\s*"(\w+)"', text))
    return kinds


def test_every_event_kind_has_words() -> None:
    kinds = server_event_kinds()
    assert {"rank_dead", "rank_left", "rollback_set", "restore_fallback"} <= kinds, kinds
    script = (ROOT / "server" / "static" / "dashboard.js").read_text("utf-8")
    table = script[script.index("const EVENT_TEXT = {"):]
    table = table[:table.index("};")]
    worded = set(re.findall(r"^\s*(\w+):", table, re.MULTILINE))
    assert kinds <= worded, f"events shown by their raw kind: {sorted(kinds - worded)}"


def test_a_rank_that_left_and_a_restore_that_fell_back_read_in_words(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            put_step(c, JOB, 1, 2, rows=4)
            put_step(c, JOB, 2, 2, rows=4)
            beat(c, JOB, 0, 2, step=3)
            beat(c, JOB, 1, 2, step=3)
            assert c.delete(f"/v1/jobs/{JOB}/ranks/1/heartbeat").status_code == 204
            (srv.store / "jobs" / JOB / "steps" / "2" / "commit.json").write_bytes(b"garbage")
            plan = c.get(f"/v1/jobs/{JOB}/restore-plan", params={"rank": 0})
            assert plan.status_code == 200, plan.text
            kinds = [e["kind"] for e in c.get(f"/v1/jobs/{JOB}/events").json()["events"]]
            assert {"rank_left", "restore_fallback"} <= set(kinds), kinds
        with browser_page() as page:
            page.goto(srv.url + "/")
            card = page.locator(f'article[data-job="{JOB}"]')
            card.locator('tr[data-state="left"]').wait_for(timeout=15_000)
            # (found by a probe: no pill for the rank that left, and its count NaN)
            pill = card.locator(".job-head .pill-left")
            assert pill.count() == 1 and pill.inner_text().strip() == "1 left"
            assert card.locator(".pill-left").first.evaluate(
                "(e) => getComputedStyle(e).backgroundColor") != "rgba(0, 0, 0, 0)"
            text = card.inner_text()
            assert "NaN" not in text
            # (found by a probe: "rank_left" and "restore_fallback" as they are)
            events = card.locator("ul.events").inner_text()
            assert "rank 1 left at step 3" in events, events
            assert "rank 0 restores step 1, older than latest" in events, events
            assert "rank_left" not in events and "restore_fallback" not in events
            assert not page.errors, page.errors
    finally:
        srv.stop()
