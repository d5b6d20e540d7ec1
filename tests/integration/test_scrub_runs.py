"""``ckptd scrub`` through a real ``ckptd serve`` runs in the background on the server
(``POST /v1/scrub/runs``) and is followed (``GET /v1/scrub``), as ``ckptd gc`` is: no
request lasts the pass, which at ``CKPTD_SCRUB_RATE`` takes minutes on a large store
(a reverse proxy's read timeout cut the one request it was). A slow rate here stands
for a large store."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.format import chunk_key
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import ckptd

pytestmark = pytest.mark.timeout(180)

JOB = "job"


async def _fill(root: Path) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    for step in (1, 2, 3):
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, manifest, chunks)
        assert (await repo.commit(JOB, step)).state == "committed"
    await repo.close()


def _store(tmp_path: Path) -> tuple[Path, int, int]:
    """A store of three committed steps: its root, its chunks and their bytes."""
    root = tmp_path / "store"
    asyncio.run(_fill(root))
    files = [p for p in (root / "chunks").rglob("*") if p.is_file()]
    return root, len(files), sum(p.stat().st_size for p in files)


def _serve(root: Path, size: int, pass_s: float) -> ServerProcess:
    """A server whose scrub reads the store in about ``pass_s`` seconds."""
    srv = ServerProcess(store=root, env={"CKPTD_SCRUB_RATE": str(size / pass_s)})
    srv.start()
    return srv


def _ended(srv: ServerProcess, run_id: str, within: float = 60) -> dict[str, Any]:
    """``GET /v1/scrub`` once ``run_id`` ended."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        status: dict[str, Any] = httpx.get(f"{srv.url}/v1/scrub", timeout=10).json()
        if status["last_run"] is not None and status["last_run"]["id"] == run_id:
            return status
        time.sleep(0.2)
    raise AssertionError(f"scrub {run_id} did not end within {within} s: {status}")


def test_a_scrub_run_answers_at_once_and_get_follows_it_to_its_report(tmp_path: Path
                                                                       ) -> None:
    root, chunks, size = _store(tmp_path)
    srv = _serve(root, size, pass_s=4)
    try:
        started = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/scrub/runs", timeout=10)
        assert r.status_code == 202 and time.monotonic() - started < 2, r.text
        run = r.json()
        assert run["ended_at"] is None and run["budget_bytes"] is None, run
        assert run["report"] is None and run["error"] is None, run
        # One at a time: a second start (another budget) answers the running one.
        again = httpx.post(f"{srv.url}/v1/scrub/runs", params={"budget_bytes": 1}, timeout=10)
        assert again.status_code == 202 and again.json()["id"] == run["id"], again.text
        seen = []  # (chunks_total, chunks_checked) at each look while it ran
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = httpx.get(f"{srv.url}/v1/scrub", timeout=10).json()
            if status["running"] is None:
                break
            assert status["running"]["id"] == run["id"], status
            seen.append((status["running"]["chunks_total"], status["running"]["chunks_checked"]))
            time.sleep(0.2)
        assert status["running"] is None and status["last_run"]["id"] == run["id"], status
        # Seen part way, with the total known, and only ever going forward.
        assert any(total == chunks and 0 < done < chunks for total, done in seen), seen
        assert [d for _, d in seen] == sorted(d for _, d in seen), seen
        ended = status["last_run"]
        report = ended["report"]
        assert ended["error"] is None and ended["ended_at"] - run["started_at"] >= 3, ended
        assert report["chunks_checked"] == chunks and report["bytes_checked"] == size, report
        assert report["corrupt"] == [] and report["damaged"] == {}, report
        assert ended["chunks_checked"] == chunks and status["last"] == report, status

        # A budget, as POST /v1/scrub takes it: the run stops once it read that much.
        budget = size // 3
        r = httpx.post(f"{srv.url}/v1/scrub/runs", params={"budget_bytes": budget}, timeout=10)
        assert r.status_code == 202 and r.json()["budget_bytes"] == budget, r.text
        report = _ended(srv, r.json()["id"])["last_run"]["report"]
        assert budget <= report["bytes_checked"] < size, report
        assert 0 < report["chunks_checked"] < chunks, report
        refused = httpx.post(f"{srv.url}/v1/scrub/runs", params={"budget_bytes": -1},
                             timeout=10)
        assert refused.status_code == 400 and "budget_bytes" in refused.text, refused.text
    finally:
        srv.stop()


def _said(out: str) -> str:
    """A scrub's report as printed, its time left out."""
    return re.sub(r" in \d+\.\d\d s", " in - s", " ".join(out.split()))


def test_the_cli_follows_a_scrub_on_the_server_and_reports_as_before(tmp_path: Path
                                                                      ) -> None:
    """It says how far the scrub is on stderr as it goes; its report and exit code
    (1: damage) are those of the same scrub done on the store itself."""
    root, chunks, size = _store(tmp_path)
    victim = demo_step(JOB, 3, 2)[0][0].entries[0].chunks[0]  # model.w of step 3 only
    path = root / chunk_key(victim)
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    direct = ckptd("scrub", "--url", f"file://{copy}")
    srv = _serve(root, size, pass_s=3)
    try:
        done = ckptd("scrub", "--url", srv.url)
    finally:
        srv.stop()
    said = done.stdout + done.stderr
    assert direct.returncode == 1 and done.returncode == 1, said
    assert "Traceback" not in said and "timeout" not in said, said
    assert f"corrupt {victim}" in done.stdout and "damaged job steps [3]" in done.stdout, said
    assert _said(done.stdout) == _said(direct.stdout), (done.stdout, direct.stdout)
    assert re.search(rf"scrubbing on the server: \d+ of {chunks} chunks checked \(.*\), "
                     r"\d+ corrupt", done.stderr), said


def test_a_second_scrub_follows_the_running_one_and_ctrl_c_leaves_it_running(
        tmp_path: Path) -> None:
    root, chunks, size = _store(tmp_path)
    srv = _serve(root, size, pass_s=60)
    try:
        started = httpx.post(f"{srv.url}/v1/scrub/runs", timeout=10).json()
        base = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "scrub", "--budget", "1000", "--url", srv.url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)
        try:
            assert proc.stderr is not None
            first = proc.stderr.readline()  # blocks until the line (or the end of stderr)
            assert "already under way" in first, first
            assert "(a whole pass, not a 1000 B budget asked)" in first, first
            progress = proc.stderr.readline()
            assert f"of {chunks} chunks checked" in progress, progress
            proc.send_signal(signal.SIGINT)
            _, rest = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=15)
        assert proc.returncode == 130, rest
        assert f"scrub {started['id']} goes on on the server" in rest, rest
        assert "`ckptd scrub` again follows it" in rest and "Traceback" not in rest, rest
        running = httpx.get(f"{srv.url}/v1/scrub", timeout=10).json()["running"]
        assert running is not None and running["id"] == started["id"], running
    finally:
        srv.stop()


def test_a_server_stopped_mid_scrub_stops_promptly(tmp_path: Path) -> None:
    """A background scrub ends with the server, which does not wait for its pass
    (nor for the 30 s it gives requests in flight)."""
    root, chunks, size = _store(tmp_path)
    srv = _serve(root, size, pass_s=120)
    try:
        r = httpx.post(f"{srv.url}/v1/scrub/runs", timeout=10)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            running = httpx.get(f"{srv.url}/v1/scrub", timeout=10).json()["running"]
            if running["chunks_checked"] > 0:
                break
            time.sleep(0.1)
        assert 0 < running["chunks_checked"] < chunks, running
        proc = srv.proc
        assert proc is not None
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - stopping
    finally:
        srv.stop()
    log = srv.log()
    assert took < 5 and code in (0, 128 + signal.SIGTERM), (took, code, log[-2000:])
    assert "Application shutdown complete" in log and "Traceback" not in log, log[-4000:]


def test_a_server_from_before_scrub_runs_is_scrubbed_in_its_one_call(tmp_path: Path) -> None:
    """(Found by review.) A server older than ``/v1/scrub/runs`` answers ``GET
    /v1/scrub`` 405: the command falls back to its one ``POST /v1/scrub``, as before,
    rather than failing. The older server here is this one behind a relay that
    answers 405 to the new route, as the older one's router does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    root, _, size = _store(tmp_path)
    srv = _serve(root, size, pass_s=0.5)
    asked: list[str] = []

    class Older(BaseHTTPRequestHandler):
        def _relay(self) -> None:
            asked.append(f"{self.command} {self.path}")
            if self.path.split("?")[0] in ("/v1/scrub", "/v1/scrub/runs") and (
                    self.command == "GET" or "/runs" in self.path):
                body = b'{"code": "method_not_allowed", "message": "Method Not Allowed"}'
                self.send_response(405)
            else:
                length = int(self.headers.get("Content-Length") or 0)
                answer = httpx.request(self.command, srv.url + self.path, timeout=60,
                                       content=self.rfile.read(length) if length else None,
                                       headers={k: v for k, v in self.headers.items()
                                                if k.lower() not in ("host", "content-length")})
                body = answer.content
                self.send_response(answer.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _relay

        def log_message(self, *args: object) -> None:
            pass

    try:
        with ThreadingHTTPServer(("127.0.0.1", 0), Older) as relay:
            threading.Thread(target=relay.serve_forever, daemon=True).start()
            try:
                done = ckptd("scrub", "--url", f"http://127.0.0.1:{relay.server_address[1]}")
            finally:
                relay.shutdown()
    finally:
        srv.stop()
    assert done.returncode == 0, done.stderr
    assert "checked" in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert any(a.startswith("POST /v1/scrub") and "/runs" not in a for a in asked), asked
