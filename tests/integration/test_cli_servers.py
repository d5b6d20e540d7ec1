"""A server that takes connections and never answers, and lists of URLs with a wrong
entry: the CLI says so in one or two lines within seconds (exit 2), naming the URL,
where it was silent for minutes (a timed-out read retried five times), took a wrong
URL for the job's damage, or named the whole list as one URL."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import assert_short_usage_error
from tests.listeners import http_program

pytestmark = pytest.mark.timeout(150)

REPO = Path(__file__).resolve().parents[2]
# What a CLI user waits at most for a server that does not answer.
SAY_WITHIN = 25.0


def ckptd(*args: str, env: dict[str, str] | None = None, spawn: bool = False) -> tuple[
        subprocess.CompletedProcess[str], float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    base.update({"COLUMNS": "80", **(env or {})})
    t0 = time.monotonic()
    done = run_ckptd(*args, environ=base, cwd=REPO, timeout=120, spawn=spawn)
    return done, time.monotonic() - t0


@pytest.fixture
def mute() -> Iterator[str]:
    """A port that takes connections (and their bytes) and never answers: a server
    stopped with kill -STOP, as its kernel serves it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


class _NotCkptd(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's names)
        self.send_error(404)

    def do_POST(self) -> None:  # noqa: N802
        self.send_error(501)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_program() -> Iterator[str]:
    """Another HTTP program on a port (a mistyped --url): 404 to GET, 501 to POST."""
    with http_program(_NotCkptd) as url:
        yield url


@pytest.fixture
def saved(server: ServerProcess, tmp_path: Path) -> ServerProcess:
    """The server, with job j1 at steps 10, 20 and 32."""
    with Checkpointer(server.url, "j1", shm_dir=tmp_path / "shm", serve_peers=False) as ckpt:
        for step in (10, 20, 32):
            assert ckpt.save(step, {"w": torch.full((8,), float(step))}).wait(60).state == (
                "committed")
    return server


def test_commands_against_a_server_that_never_answers_say_so_within_seconds(
        mute: str, tmp_path: Path) -> None:
    """ls was silent 330 s (then: timed out 5 times), verify past 400 s, gc --dry-run
    past 90 s."""
    commands = [["ls"], ["verify", "j1"], ["gc", "--dry-run"], ["status"],
                ["restore", "--job", "j1", "--rank", "0", "--to", str(tmp_path / "to")],
                ["export", "j1", "--safetensors", str(tmp_path / "st")]]
    with ThreadPoolExecutor(len(commands)) as pool:
        # (each its own process: they wait side by side)
        runs = list(pool.map(lambda c: ckptd(*c, "--url", mute, spawn=True), commands))
    for command, (done, took) in zip(commands, runs, strict=True):
        assert_short_usage_error(done, mute, "does not answer")
        assert took < SAY_WITHIN, f"ckptd {' '.join(command)} took {took:.1f} s"


def test_a_stopped_server_is_said_and_a_running_one_serves(saved: ServerProcess) -> None:
    """Stopped (kill -STOP), verify was silent past 400 s; running, the same commands
    answer as before."""
    assert saved.proc is not None
    saved.proc.send_signal(signal.SIGSTOP)
    try:  # (CKPTD_ANSWER_WITHIN: how long the command waits for that answer)
        done, took = ckptd("verify", "j1", "--url", saved.url, env={"CKPTD_ANSWER_WITHIN": "3"})
    finally:
        saved.proc.send_signal(signal.SIGCONT)
    assert_short_usage_error(done, saved.url, "does not answer", "in 3 s")
    assert took < 3 + 10, f"it took {took:.1f} s"
    for command in (["verify", "j1"], ["gc", "--dry-run"], ["ls", "j1"], ["status"]):
        done, _ = ckptd(*command, "--url", saved.url)
        assert done.returncode == 0, done.stdout + done.stderr
    # Ctrl-C ends a --watch that has shown the ranks: its way out, exit 0 (before
    # any answer it is 130: above).
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "status", "--watch", "0",
                             "--url", saved.url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO,
                            env={**{k: v for k, v in os.environ.items()
                                    if not k.startswith("CKPTD_")},
                                 "TTY_COMPATIBLE": "1", "COLUMNS": "120"})
    try:
        assert proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + 60
        while b"j1" not in seen and time.monotonic() < deadline:  # (a terminal's Live)
            if select.select([proc.stdout], [], [], 1.0)[0]:
                more = os.read(proc.stdout.fileno(), 65536)
                if not more:
                    break  # (it ended: said below)
                seen += more
        assert b"j1" in seen, (seen, proc.poll())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and b"Traceback" not in err, err


def test_a_list_with_another_program_names_it_and_tries_nothing_else(
        saved: ServerProcess, other_program: str) -> None:
    """rollback said 'POST http://BAD,http://GOOD/v1/jobs/j1/rollback failed after 1
    attempts: HTTP 501'; ls said j1 was damaged (exit 1)."""
    for urls in (f"{other_program},{saved.url}", f"{saved.url},{other_program}"):
        for command in (["rollback", "j1", "20"], ["ls"], ["ls", "j1"]):
            done, _ = ckptd(*command, "--url", urls)
            assert_short_usage_error(done, other_program, "does not answer as a ckptd server")
            assert urls not in done.stderr and "damaged" not in done.stderr
    done, _ = ckptd("ls", "--url", other_program)
    assert_short_usage_error(done, other_program, "does not answer as a ckptd server")


def test_a_list_with_a_server_refusing_the_token_names_it(
        saved: ServerProcess, token_server: ServerProcess) -> None:
    done, _ = ckptd("ls", "--url", f"{saved.url},{token_server.url}")
    # (none given: said so, not "refused the token", found by a probe)
    assert_short_usage_error(done, token_server.url, "needs a token and none was given")
    assert "damaged" not in done.stderr
    done, _ = ckptd("ls", "--url", token_server.url, env={"CKPTD_TOKEN": "wrong"})
    assert_short_usage_error(done, token_server.url, "refused the token", "--token")


def test_a_list_of_servers_that_are_no_replicas_of_one_store_says_so(
        saved: ServerProcess, tmp_path: Path) -> None:
    """A second ckptd over another store: ls showed '32 (damaged)' (exit 0), and
    ls j1 'no job j1 at ...; jobs there: j1'."""
    other = ServerProcess(store=tmp_path / "other-store")
    other.start()
    try:
        urls = f"{saved.url},{other.url}"
        for command in (["ls"], ["ls", "j1"], ["rollback", "j1", "20"]):
            done, _ = ckptd(*command, "--url", urls)
            assert_short_usage_error(done, saved.url, "serves alone", "--peers")
            assert "damaged" not in done.stderr and "no job" not in done.stderr
    finally:
        other.stop()


def test_an_https_entry_of_a_plain_http_server_in_a_list_says_so(
        saved: ServerProcess) -> None:
    """A single such URL said 'speaks plain HTTP, not TLS'; in a list it was
    'unreachable (ConnectError)'."""
    wrong = saved.url.replace("http://", "https://")
    for command in (["ls"], ["rollback", "j1", "20"]):
        done, _ = ckptd(*command, "--url", f"{wrong},{saved.url}")
        assert_short_usage_error(done, "speaks plain HTTP, not TLS", saved.url)
        assert "ConnectError" not in done.stderr


@pytest.mark.parametrize("command", [["ls"], ["verify", "j1"], ["status"],
                                     ["status", "--watch", "0"]])
def test_ctrl_c_while_a_server_is_silent_ends_the_command_at_once(
        mute: str, command: list[str]) -> None:
    """The check waited out its 10 s before Ctrl-C took effect (a pool's threads
    are joined at exit; an event loop's SIGINT handler waits for the loop). Exit
    130, the shell's for SIGINT: ``status`` said 0, as if it had answered (a watch
    that has shown the ranks ends with Ctrl-C: exit 0, below)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", *command, "--url", mute],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
        time.sleep(2.5)  # (started, and waiting on the silent server)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert took < 3.0, f"ckptd {' '.join(command)} ended {took:.1f} s after Ctrl-C"


def test_a_replica_that_refuses_is_said_to_refuse_not_to_time_out(tmp_path: Path) -> None:
    """(Found by a probe: the replica-list check passed over a replica that refused
    the connection as 'unreachable (TimeoutError)'.)"""
    from tests.conftest import free_port

    port, gone = free_port(), free_port()
    urls = f"http://127.0.0.1:{port},http://127.0.0.1:{gone}"
    srv = ServerProcess(store=tmp_path / "store", port=port, extra_args=["--peers", urls])
    srv.start()
    try:
        done, _ = ckptd("ls", "--url", urls)
    finally:
        srv.stop()
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "unreachable" in line]
    assert f"127.0.0.1:{gone}" in line and "ConnectionRefusedError" in line, line


def test_a_host_name_that_does_not_resolve_is_said_at_once() -> None:
    """(Found by a probe: ``--url http://nohost.invalid:8470`` retried for seconds,
    then said to start a server there.) ``.invalid`` never resolves (RFC 2606)."""
    try:
        socket.getaddrinfo("nohost.invalid", 8470)
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_NONAME:  # no resolver to say "no such name" here
            pytest.skip(f"this host's resolver answers {exc} for a .invalid name")
    else:
        pytest.skip("this host's resolver gives an address for nohost.invalid")
    (alone, took), (listed, _) = (ckptd("ls", "--url", url) for url in (
        "http://nohost.invalid:8470", "http://nohost.invalid:8470,http://127.0.0.1:9"))
    for done in (alone, listed):
        assert_short_usage_error(done, "'nohost.invalid' does not resolve", "--url")
        assert "ckptd serve" not in done.stderr, done.stderr  # no server to start there
    assert took < 5.0, took



def test_a_watch_started_before_its_job_waits_for_it(saved: ServerProcess) -> None:
    """(Found by review.) ``GET /v1/overview?job=J`` answers 404 for a job no one
    knows (563e3b8): a watch started before its job's first heartbeat ended at once
    with job_not_found, where it showed the job with no ranks yet and kept watching."""
    done, took = ckptd("status", "--watch", "2", "--every", "0.5", "not-yet", "--url",
                       saved.url)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "no heartbeats from this job's ranks" in said, said
    assert "job_not_found" not in said and took >= 2.0, (took, said)
    once, _ = ckptd("status", "not-yet", "--url", saved.url)  # (without --watch: said)
    assert once.returncode == 2 and "no job 'not-yet'" in once.stderr, once.stderr
