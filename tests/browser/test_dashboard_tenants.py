"""The dashboard as a tenant's token sees it (``--tokens-file``), in headless Chromium
against a real ``ckptd serve``: the server sends a token that is not on every job
no store and zeroed counters (docs/SECURITY.md), so the page must not draw them as
the store's, and a token that sees no job is told so, not that the store is empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.tokens import create_token
from tests.browser.test_dashboard import _chromium, browser_page, put_step  # noqa: F401
from tests.conftest import ServerProcess

pytestmark = pytest.mark.slow
ROOT = "root-dash-token"


def sign_in(page: Any, token: str) -> None:
    """Forgets the tab's token if it has one, then gives ``token`` to the login form."""
    if page.locator("#signout").is_visible():
        page.click("#signout")
    page.wait_for_selector("#login:not([hidden])", timeout=15_000)
    page.fill("#token", token)
    page.click("#login-form button")
    page.wait_for_selector("#login", state="hidden", timeout=15_000)


def test_a_tenant_sees_its_jobs_not_the_store_counters(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.json"
    team_a, _ = create_token(tokens_file, "team-a-*", "read")
    nobody, _ = create_token(tokens_file, "team-z-*", "read")
    srv = ServerProcess(store=tmp_path / "store", token=ROOT,
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
            put_step(c, "team-a-train", 10, 1, rows=8)
            put_step(c, "team-b-train", 10, 1, rows=8)
        with browser_page() as page:
            page.goto(srv.url + "/")
            sign_in(page, team_a)
            page.wait_for_selector('article[data-job="team-a-train"]', timeout=15_000)
            storage = page.inner_text("#storage")
            # (found by a probe: "Stored 0 B", "Commits 0", "Dedup –", as if the store
            # were empty, while it held both teams' steps)
            for card in ("Stored", "Commits", "Dedup", "Uploads", "Restores"):
                assert card.lower() not in storage.lower(), storage
            assert "operator only" in storage
            assert page.locator('article[data-job="team-b-train"]').count() == 0

            sign_in(page, nobody)
            page.wait_for_selector("#empty-scoped:not([hidden])", timeout=15_000)
            # (found by a probe: "No jobs yet: nothing has been checkpointed", while
            # the store had two jobs)
            assert page.locator("#empty").is_hidden()
            assert "This token sees no jobs" in page.inner_text("main")

            sign_in(page, ROOT)  # the operator sees the counters, as before
            page.wait_for_selector('article[data-job="team-b-train"]', timeout=15_000)
            storage = page.inner_text("#storage").lower()  # (the labels are upper case)
            assert "commits" in storage and "operator only" not in storage
            assert page.locator("#empty-scoped").is_hidden()
            errors = [e for e in page.errors if "401" not in e]
            assert not errors, errors
    finally:
        srv.stop()
