"""Mistakes a reviewer made on the command line (review r1): each is one or two lines
that say what to do, exit code 2, never a traceback; both transports (a server and a
file:// store) answer a bad lifecycle option alike."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.test_cli_mistakes import (
    _save_one,
    assert_short_usage_error,
    ckptd,
    ckptd_each,
)

if TYPE_CHECKING:
    from tests.conftest import ServerProcess


@pytest.fixture
def saved_store(tmp_path: Path, shm: Path) -> str:
    """A file:// store holding step 1 of job llm-7b."""
    url = f"file://{tmp_path / 'files'}"
    _save_one(url, "llm-7b", shm)
    return url


# -- 1. tracebacks ------------------------------------------------------------------------


def test_export_into_a_directory_that_cannot_be_made(saved_store: str, tmp_path: Path) -> None:
    done = ckptd("export", "llm-7b", "1", "--zarr", "/proc/x.zarr", "--url", saved_store)
    assert_short_usage_error(done, "/proc/x.zarr", "directory you can write")


def test_import_of_files_that_are_no_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "mk.py"
    script.write_text("import torch\nprint(torch.ones(2))\n")
    url = f"file://{tmp_path / 'store'}"
    # a torch.save file cut short (the legacy format's magic number, then nothing)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9")
    sources = ("/proc/self/status", str(script), str(cut))
    *neither, done = ckptd_each(*(["import", source, "--job", "imp", "--step", "9", "--url",
                                   url] for source in sources))
    for source, answer in zip(sources[:2], neither, strict=True):
        assert_short_usage_error(answer, source, "neither a zarr v3 hierarchy")
    assert_short_usage_error(done, str(cut), "not a readable torch.save file")


def test_import_of_a_pickle_of_objects_says_why_in_plain_text(tmp_path: Path) -> None:
    """(found by a probe: torch's refusal, ANSI bold codes and all, cut off before the
    line that named the object)"""
    import datetime

    import torch

    source = tmp_path / "objects.pt"
    torch.save({"w": torch.ones(2), "when": datetime.datetime(2026, 1, 1)}, source)
    done = ckptd("import", str(source), "--job", "imp", "--step", "9",
                 "--url", f"file://{tmp_path / 'store'}")
    assert_short_usage_error(done, str(source), "datetime.datetime",
                             "does not unpickle", "plain tensors")
    assert "\x1b" not in done.stderr, done.stderr


@pytest.mark.parametrize("args,needles", [
    (["--retention", "/nonexist.toml"], ["/nonexist.toml"]),
    (["--peers", "garbage"], ["--peers", "garbage", "http://"]),
    # (found by a probe: "give both tls-cert and tls-key", the settings' field names)
    (["--tls-cert", "/nonexist.pem"], ["give both --tls-cert and --tls-key"]),
    # (found by a probe: refused only over a store that cannot write conditionally)
    (["--single-writer", "--member-leases", "--check"], ["--single-writer", "--member-leases"]),
])
def test_serve_checks_its_files_and_peers_before_it_starts(
    args: list[str], needles: list[str], tmp_path: Path
) -> None:
    done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", "0", *args)
    assert_short_usage_error(done, *needles)
    assert not (tmp_path / "s").exists()  # a refused start leaves no store behind


def test_serve_on_a_port_in_use_leaves_no_store_behind(tmp_path: Path) -> None:
    """(Found by a probe: the store's directory was made, then the port refused.)"""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = ckptd("serve", "--store", str(tmp_path / "new" / "store"), "--port", str(port))
    assert_short_usage_error(done, f"port {port}", "already in use")
    assert not (tmp_path / "new").exists()


# -- 2. lifecycle options: checked alike on both transports ------------------------------


LIFECYCLE_BAD = [
    (["forget", "llm-7b", "--keep-last", "0"], "--keep-last"),
    (["forget", "llm-7b", "--keep-last", "-3"], "--keep-last"),
    (["gc", "--grace", "-5"], "--grace"),
    (["scrub", "--budget", "-1"], "--budget"),
]


def test_bad_lifecycle_options_are_refused_alike_by_both_transports(
    shared_server: ServerProcess, saved_store: str
) -> None:
    bad = [(url, args, option) for url in (shared_server.url, saved_store)
           for args, option in LIFECYCLE_BAD]
    *refused, listed = ckptd_each(*([*args, "--url", url] for url, args, _ in bad),
                                  ["ls", "llm-7b", "--url", saved_store])
    for (_, _, option), done in zip(bad, refused, strict=True):
        assert_short_usage_error(done, option)
    assert listed.returncode == 0 and "committed" in listed.stdout, listed.stdout


@pytest.mark.parametrize("args,needles", [
    (["forget", "llm-7b", "--retention", "r.toml"], ["--retention", "--keep-last"]),
    (["scrub", "--replica", "file:///tmp/r"], ["--replica", "file:///"]),
])
def test_store_only_options_through_a_server_are_refused(
    args: list[str], needles: list[str], shared_server: ServerProcess
) -> None:
    assert_short_usage_error(ckptd(*args, "--url", shared_server.url), *needles)


async def test_lifecycle_functions_refuse_negative_limits(tmp_path: Path) -> None:
    from ckptd.errors import InvalidRequest
    from ckptd.lifecycle.gc import collect_garbage
    from ckptd.lifecycle.retention import RetentionPolicy, forget
    from ckptd.lifecycle.scrub import scrub
    from ckptd.repository import Repository
    from ckptd.store import open_store

    repo = Repository(open_store(str(tmp_path / "s")))
    try:
        for policy in (RetentionPolicy(keep_last=0), RetentionPolicy(keep_every=-2)):
            with pytest.raises(InvalidRequest, match="must be >= 1"):
                await forget(repo, "j", policy)
        with pytest.raises(InvalidRequest, match="grace"):
            await collect_garbage(repo.store, grace=-5)
        with pytest.raises(InvalidRequest, match="budget"):
            await scrub(repo, budget_bytes=-1)
    finally:
        await repo.close()


def test_keep_last_zero_is_sent_not_dropped() -> None:
    from ckptd.client import calls

    assert calls.forget("j", False, 0).params == {"dry_run": False, "keep_last": 0}


# -- 3. a retention file that holds no rule is refused, saying what it should look like ----


@pytest.mark.parametrize("text", ["keep_last = 1\n", "# nothing yet\n",
                                  "[retention]\nkeep_tagged = false\n"])
def test_retention_file_without_a_rule_is_refused(text: str, saved_store: str,
                                                  tmp_path: Path) -> None:
    from ckptd.errors import InvalidPolicy
    from ckptd.lifecycle.retention import parse_retention

    with pytest.raises(InvalidPolicy, match=r"\[retention\]"):
        parse_retention(text, "r.toml")
    rules = tmp_path / "r.toml"
    rules.write_text(text)
    for done in ckptd_each(["forget", "llm-7b", "--retention", str(rules), "--url", saved_store],
                           ["serve", "--store", str(tmp_path / "s"), "--port", "0",
                            "--retention", str(rules)]):
        assert_short_usage_error(done, str(rules), "[retention]", "docs/retention.md")


def test_retention_file_with_rules_for_other_jobs_says_so(saved_store: str,
                                                         tmp_path: Path) -> None:
    rules = tmp_path / "r.toml"
    rules.write_text("[retention.jobs.other]\nkeep_last = 1\n")
    done = ckptd("forget", "llm-7b", "--retention", str(rules), "--url", saved_store)
    assert_short_usage_error(done, "no rule for llm-7b", "[retention.jobs.llm-7b]")


# -- 4. gc through a server says what it waits for, whom it follows, and what Ctrl-C leaves -


@pytest.mark.slow
def test_gc_through_a_server_says_what_it_waits_for(server: ServerProcess) -> None:
    import httpx

    # A grace that outlasts the CLI's start on a loaded 2-core machine (3 s did not:
    # the run had ended, and the CLI's gc was a run of its own).
    started = httpx.post(f"{server.url}/v1/gc/runs", params={"grace": 10}, timeout=10)
    assert started.status_code == 202, started.text
    joined = ckptd("gc", "--grace", "0", "--url", server.url)
    assert joined.returncode == 0, joined.stderr
    assert "already under way" in joined.stderr and "grace 10 s" in joined.stderr, joined.stderr
    assert "not the 0 s asked" in joined.stderr, joined.stderr

    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "gc", "--grace", "30", "--url",
                             server.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=base)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # blocks until the line (or the end of stderr)
        assert "waiting out the 30 s grace period" in first and "s left" in first, first
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "goes on on the server" in rest and "Traceback" not in rest, rest
    running = httpx.get(f"{server.url}/v1/gc", timeout=10).json()["running"]
    assert running is not None and running["grace"] == 30, running


# -- 5. a file:// URL with a host is refused, not read as another path ---------------------


@pytest.mark.parametrize("args", [["ls"], ["gc", "--dry-run"], ["serve", "--port", "0"]])
def test_file_url_with_a_host_is_refused(args: list[str], tmp_path: Path) -> None:
    (tmp_path / "relative" / "x").mkdir(parents=True)
    option = "--store" if args[0] == "serve" else "--url"
    done = ckptd(*args, option, "file://relative/x", cwd=tmp_path)
    assert_short_usage_error(done, "file:///absolute/path")


# -- 6. another program on the port is named as such, in one line -------------------------


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP file server (not ckptd) on loopback: /v1/jobs is an HTML page."""
    import functools
    from http.server import SimpleHTTPRequestHandler

    from tests.listeners import http_program

    (tmp_path / "www" / "v1").mkdir(parents=True)
    (tmp_path / "www" / "v1" / "jobs").write_text("<!DOCTYPE HTML>\n<html>\n<body>\n" * 10)
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # (its lines on stderr are not the command's: it runs in this process)

    with http_program(functools.partial(Quiet, directory=str(tmp_path / "www"))) as url:
        yield url


def test_a_url_that_is_no_ckptd_server_is_named_in_one_line(web_server: str) -> None:
    # a 200 HTML page, and a 404 one
    for done in ckptd_each(["ls", "--url", web_server], ["ls", "llm-7b", "--url", web_server]):
        assert_short_usage_error(done, f"{web_server} does not answer as a ckptd server")
        assert "<html> <body>" in done.stderr or "HTTP 404" in done.stderr, done.stderr


def test_checkpointer_latest_against_another_program_says_so(web_server: str) -> None:
    from ckptd.client import Checkpointer
    from ckptd.errors import InvalidRequest

    # Said at construction, where the checkpointer first asks its server.
    with pytest.raises(InvalidRequest, match="does not answer as a ckptd server") as caught:
        Checkpointer(web_server, job="j", rank=0, world_size=1)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300, caught.value

# -- 7. a bad tag name is named before any request ----------------------------------------


def test_bad_tag_name_is_refused_as_the_store_refuses_it(shared_server: ServerProcess,
                                                         saved_store: str) -> None:
    for done in ckptd_each(*([*args, "--url", url] for url in (shared_server.url, saved_store)
                             for args in (["tag", "llm-7b", "1", "bad name/x"],
                                          ["untag", "llm-7b", "bad name/x"]))):
        assert_short_usage_error(done, "[invalid_name]", "bad name/x")


# -- 9. smaller ones -----------------------------------------------------------------------


def test_verify_of_an_unknown_job_names_the_jobs_there(saved_store: str) -> None:
    assert_short_usage_error(ckptd("verify", "nosuch", "--url", saved_store),
                             "nosuch", "llm-7b")


@pytest.mark.parametrize("args", [["token", "list", "--file", "/nonexist/tokens.json"],
                                  ["serve", "--port", "0", "--tokens-file",
                                   "/nonexist/tokens.json"]])
def test_a_tokens_file_that_is_not_there_is_named(args: list[str], tmp_path: Path) -> None:
    done = ckptd(*args, cwd=tmp_path)
    assert_short_usage_error(done, "/nonexist/tokens.json", "token create")


def test_serve_check_reads_the_tokens_file_as_serve_does(tmp_path: Path) -> None:
    """(Found by a probe: --check said "ok: would serve" for a file serve refused.)"""
    bad = tmp_path / "tokens.json"
    bad.write_text('{"nope": 1}')
    done = ckptd("serve", "--check", "--port", "0", "--store", str(tmp_path / "s"),
                 "--tokens-file", str(bad))
    assert_short_usage_error(done, "--tokens-file", "not a ckptd.tokens document")


def test_every_serve_option_names_its_environment_variable() -> None:
    from typer.main import get_command

    from ckptd.cli import app

    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    actions = {"help", "check"}  # what the command does this once, not a setting to keep
    for param in serve.params:
        if param.name not in actions:
            assert f"Env CKPTD_{param.name.upper()}" in (param.help or ""), param.name


def test_client_urls_and_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.client import Checkpointer
    from ckptd.errors import InvalidRequest
    from ckptd.zarr import CheckpointStore

    with pytest.raises(InvalidRequest, match="url must be a string"):
        Checkpointer(1234)  # type: ignore[arg-type]
    monkeypatch.setenv("CKPTD_TOKEN", "from-the-environment")
    assert CheckpointStore("http://127.0.0.1:9", "j").token == "from-the-environment"


def test_one_replica_is_not_said_to_fail_over(caplog: pytest.LogCaptureFixture) -> None:
    from ckptd.client.routing import Members

    with caplog.at_level("WARNING"):
        Members(["http://127.0.0.1:9"]).mark_down("http://127.0.0.1:9", ConnectionError())
        assert "next one" not in caplog.text
        Members(["http://127.0.0.1:9", "http://127.0.0.1:10"]).mark_down(
            "http://127.0.0.1:9", ConnectionError())
        assert "next one" in caplog.text


def test_interrupted_restore_says_so(tmp_path: Path) -> None:
    import socket
    import time

    # A server that takes connections and never answers: the restore waits in its
    # first request until the interrupt.
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    proc: subprocess.Popen[str] | None = None
    try:
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "restore", "--job", "j",
                                 "--rank", "0", "--to", str(tmp_path / "to"), "--url", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=base)
        # Interrupted once it waits in its first request (not during its imports,
        # which take seconds on a loaded machine): the mute server took it.
        mute.settimeout(60)
        conn, _ = mute.accept()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        conn.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        mute.close()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and str(tmp_path / "to") in err and "Traceback" not in err, err


# -- 10. a probe of the CLI (r2): run in this process, each a CliRunner -------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptd ARGS`` in this process, in the test's working directory."""
    return ckptd(*args, cwd=Path.cwd())


@contextlib.contextmanager
def read_only_directory(where: Path) -> Iterator[Path]:
    """An empty directory on a read-only file system (a tmpfs mounted ro: root only)."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only file system needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_export_into_a_read_only_directory_is_one_line(saved_store: str,
                                                       tmp_path: Path) -> None:
    """(Found by a probe: the line, then a traceback of 40 lines from the cleanup's
    unlink, which the read-only file system refused too.)"""
    with read_only_directory(tmp_path / "ro") as target:
        done = cli("export", "llm-7b", "--safetensors", str(target), "--url", saved_store)
    assert_short_usage_error(done, f"cannot write {target}/model.safetensors",
                             "Read-only file system", "export elsewhere")


def test_a_tenants_reasons_are_printed_with_control_characters_written_out(
        server: ServerProcess, shm: Path) -> None:
    """(Found by a probe: a rollback's --reason with an escape sequence in it reached
    the terminal of whoever ran ``ckptd status``, and a newline forged a line.)"""
    from ckptd.cli.status import status_view

    _save_one(server.url, "llm-7b", shm)
    forged = "line1\nline2\x1b[31mred"
    done = cli("rollback", "llm-7b", "1", "--reason", forged, "--url", server.url)
    assert done.returncode == 0, done.stderr
    shown = cli("status", "llm-7b", "--url", server.url)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "line1\\nline2\\x1b[31mred" in shown.stdout, \
        shown.stdout
    # A rank's health reasons and a snapshot's reason, as a server sends them.
    rank = {"rank": 0, "state": "degraded", "step": 1, "held_step": None, "age_s": 1.0,
            "rtt_ms": None, "health": {"reasons": [f"hot {forged}"], "signals": {}}}
    job = {"job": "llm-7b", "latest": 1, "world_size": 1, "snapshot_at": 2,
           "snapshot_reason": f"asked {forged}", "rollback_to": None, "ranks": [rank],
           "events": []}
    from rich.console import Console

    for width in (200, 40):  # the reasons in their column, and under a compact table
        out = Console(width=width, record=True, force_terminal=False)
        out.print(status_view({"jobs": [job]}, width))
        text = out.export_text()
        assert "\x1b" not in text and text.count("line2\\x1b[31mred") == 2, text


def test_rollback_tag_and_untag_of_a_job_not_there_name_the_jobs_there(
        server: ServerProcess, saved_store: str, shm: Path) -> None:
    """(Found by a probe: ``rollback nojob --clear`` said "cleared", exit 0; a rollback
    or a tag "no checkpoint at step 1 of nojob"; an untag "nojob has no tag".) And a
    --reason a server refuses ("body.reason") is refused alike on a store, which took
    any length."""
    _save_one(server.url, "llm-7b", shm)
    for url in (server.url, saved_store):
        for args in (["rollback", "nojob", "--clear"], ["rollback", "nojob", "1"],
                     ["tag", "nojob", "1", "best"], ["untag", "nojob", "best"]):
            assert_short_usage_error(cli(*args, "--url", url), "no job 'nojob'",
                                     "jobs there: llm-7b")
        assert_short_usage_error(cli("untag", "llm-7b", "best", "--url", url),
                                 "llm-7b has no tag 'best'")
        done = cli("rollback", "llm-7b", "1", "--reason", "x" * 1025, "--url", url)
        assert_short_usage_error(done, "--reason is 1025 characters long", "at most 1024")
        assert cli("rollback", "llm-7b", "1", "--reason", "x" * 1024, "--url",
                   url).returncode == 0
        told = cli("rollback", "llm-7b", "1", "--url", url)  # (its advice kept --url)
        assert f"`ckptd rollback llm-7b --clear --url {url}`" in " ".join(
            told.stdout.split()), told.stdout
        done = cli("rollback", "llm-7b", "--clear", "--url", url)
        assert done.returncode == 0 and "rollback of llm-7b to step 1 cleared" in done.stdout
        # (found by a probe: a marker never set, or cleared already, was "cleared")
        done = cli("rollback", "llm-7b", "--clear", "--url", url)
        assert done.returncode == 0 and "no rollback of llm-7b is set: nothing to clear" in \
            done.stdout, done.stdout + done.stderr


def test_a_bare_path_is_a_store_to_every_command(saved_store: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a probe: gc, space, tag ... took ``--url DIR``; ls, verify, diff,
    restore, export and import said "unsupported URL 'DIR'".)"""
    store = saved_store.removeprefix("file://")
    monkeypatch.chdir(Path(store).parent)
    relative = Path(store).name
    for n, url in enumerate((store, relative)):
        for args in (["ls"], ["ls", "llm-7b"], ["verify", "llm-7b"],
                     ["diff", "llm-7b", "1", "1"],
                     ["export", "llm-7b", "--safetensors", str(tmp_path / f"st{n}")],
                     ["restore", "--job", "llm-7b", "--rank", "0", "--to", str(tmp_path / "r")],
                     ["import", str(tmp_path / f"st{n}"), "--job", "imported", "--step",
                      str(n + 3)],
                     ["space"]):
            done = cli(*args, "--url", url)
            assert done.returncode == 0, (args, url, done.stderr)
    assert "imported" in cli("ls", "--url", relative).stdout


@pytest.mark.parametrize("args", [["ls"], ["verify", "j"], ["status"], ["space"],
                                  ["rollback", "j", "--clear"],
                                  ["export", "j", "--zarr", "/tmp/x"]])
def test_a_server_url_is_host_and_port_and_nothing_else(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a probe: ``localhost:8470`` was "no store at CWD/localhost:8470";
    ``http://host:port/v1`` gave "no route for POST /v1/v1/...".)"""
    monkeypatch.chdir(tmp_path)
    assert_short_usage_error(cli(*args, "--url", "localhost:8470"),
                             "did you mean http://localhost:8470?")
    for url in ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/?x=1"):
        assert_short_usage_error(cli(*args, "--url", url), repr(url),
                                 "a server URL is http://host:port, nothing after the port")


def test_restore_says_rank_and_to_as_the_options_are_named(saved_store: str,
                                                          tmp_path: Path) -> None:
    """(Found by a probe: "(check rank= and world_size=)", the API's words; and
    "[store_error] cannot create store directory ...: [Errno 17] File exists".)"""
    done = cli("restore", "--job", "llm-7b", "--rank", "1", "--to", str(tmp_path / "r"),
               "--url", saved_store)
    assert_short_usage_error(done, "--rank 1: job 'llm-7b' has a world size of 1",
                             "--rank is 0 to 0")
    assert "rank=" not in done.stderr, done.stderr
    file = tmp_path / "a-file"
    file.write_text("")
    for to in (str(file), f"file://{file}/under"):
        done = cli("restore", "--job", "llm-7b", "--rank", "0", "--to", to, "--url",
                   saved_store)
        assert_short_usage_error(done, f"--to {to}", "a file", "give a directory")


def test_revoking_a_token_that_is_not_there_is_a_users_mistake(tmp_path: Path) -> None:
    """(Found by a probe: exit 1, which the CLI keeps for damage found.)"""
    tokens = tmp_path / "tokens.json"
    assert cli("token", "create", "--job", "j", "--role", "read", "--file",
               str(tokens)).returncode == 0
    assert_short_usage_error(cli("token", "revoke", "nosuchid", "--file", str(tokens)),
                             "no token nosuchid", "ckptd token list")


def test_restore_and_export_of_a_job_not_there_name_the_jobs_a_token_sees(
        tmp_path: Path, shm: Path) -> None:
    """(Found by a probe: they said "job nope has no committed checkpoint", where ls
    and verify name the jobs there.) Through a server the list is the one the token
    may see: a tenant never learns another tenant's job names from a typo."""
    import torch

    from ckptd.client import Checkpointer
    from ckptd.tokens import create_token
    from tests.conftest import ServerProcess

    tokens_file = tmp_path / "tokens.json"
    scoped, _ = create_token(tokens_file, "llm-*", "read")
    srv = ServerProcess(store=tmp_path / "store", token="ADMIN",
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        for job in ("llm-a", "other-b"):
            with Checkpointer(srv.url, job, token="ADMIN", shm_dir=str(shm)) as ckpt:
                assert ckpt.save(1, {"w": torch.ones(8)}).wait(60).state == "committed"
        commands = [["restore", "--job", "llm-nope", "--rank", "0", "--to", str(tmp_path / "to")],
                    ["export", "llm-nope", "--safetensors", str(tmp_path / "st")],
                    ["export", "llm-nope", "--zarr", str(tmp_path / "z")]]
        for args in commands:
            done = cli(*args, "--url", srv.url, "--token", scoped)
            assert_short_usage_error(done, "no job 'llm-nope'", "jobs there: llm-a")
            assert "other-b" not in done.stderr, done.stderr
            done = cli(*args, "--url", f"file://{tmp_path / 'store'}")
            assert_short_usage_error(done, "no job 'llm-nope'", "jobs there: llm-a, other-b")
        # a job that is there, at a step it does not have, is still that step's error
        done = cli("export", "llm-a", "7", "--zarr", str(tmp_path / "z"), "--url", srv.url,
                   "--token", scoped)
        assert_short_usage_error(done, "no checkpoint at step 7 of llm-a")
    finally:
        srv.stop()
    assert not any((tmp_path / d).exists() for d in ("to", "st", "z"))
