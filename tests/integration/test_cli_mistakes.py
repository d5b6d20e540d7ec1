"""A person's mistakes on the command line: every command, given bad options,
answers one or two lines on stderr and exit code 2, never a traceback; reading
commands never create a store, and an unknown job is an error naming the known."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.cli_runs import ckptd, ckptd_each

if TYPE_CHECKING:
    from tests.conftest import ServerProcess

# A port nothing listens on: reading commands fail fast, one attempt.
NOBODY = "http://127.0.0.1:9"


def assert_short_usage_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    said = done.stdout + done.stderr
    assert "Traceback" not in said, said
    assert done.returncode == 2, said
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, said
    assert not any(c in said for c in "╭│╰"), said  # no boxes
    for needle in needles:
        assert needle in said, said


# (arguments, what the answer must name: the option, the allowed values)
BAD = [
    (["serve", "--replica-mismatch", "bogus"], ["--replica-mismatch", "reject", "warn"]),
    (["serve", "--port", "99999"], ["--port", "65535"]),
    (["serve", "--port", "http"], ["--port"]),
    (["serve", "--heartbeat-interval", "0"], ["--heartbeat-interval", "greater than 0"]),
    (["serve", "--dead-after", "0"], ["--dead-after"]),
    (["serve", "--store", "ftp://x/y"], ["ftp://x/y", "s3://"]),
    (["ls", "--url", "ftp://host/x"], ["ftp://host/x", "http://"]),
    (["ls", "bad/job"], ["bad/job"]),
    (["ls", "--url", NOBODY], ["127.0.0.1:9", "ckptd serve"]),
    # (found by a probe: each of these was an 80 - 130 line traceback)
    (["ls", "--url", "http://127.0.0.1:notaport"], ["notaport", "http://host:port"]),
    (["ls", "--url", "http://127.0.0.1:99999"], ["99999", "0-65535"]),
    (["ls", "--url", "http://[::1"], ["http://[::1", "not a URL"]),
    (["ls", "--url", "http://256.1.1.1:80"], ["256.1.1.1 is not an IP address"]),
    (["ls", "--url", f"{NOBODY},http://127.0.0.1:x"], ["http://127.0.0.1:x"]),
    (["status", "--url", NOBODY], ["127.0.0.1:9", "ckptd serve"]),
    (["verify"], ["job"]),
    (["verify", "job", "notastep"], ["step"]),
    (["status", "--watch", "abc"], ["--watch"]),
    (["status", "--watch", "-1"], ["--watch"]),
    (["status", "--url", "file:///tmp"], ["http://"]),
    (["rollback", "job"], ["STEP", "--clear"]),
    (["rollback", "job", "3", "--url", "ftp://x"], ["ftp://x"]),
    (["restore"], ["--job"]),
    (["restore", "--job", "j", "--rank", "-1", "--to", "/tmp/x"], ["--rank"]),
    (["policy", "check", "/does/not/exist.toml"], ["/does/not/exist.toml"]),
    (["demo", "--nproc", "0"], ["--nproc"]),
    # (found by a probe: a file was a traceback; a directory of an earlier run's store
    # was restored from, nothing killed, and the comparison said OK)
    (["demo", "--workdir", "/etc/hostname"], ["/etc/hostname", "new or empty directory"]),
    (["demo", "--workdir", "/etc"], ["/etc", "new or empty directory"]),
    (["nosuchcommand"], ["nosuchcommand"]),
    # (found by a probe: 05 was step 5 here, and refused by the API: one spelling)
    (["export", "j", "05", "--zarr", "/tmp/x"], ["'05'", "leading zero", "latest"]),
    (["export", "j", "+5", "--zarr", "/tmp/x"], ["'+5'", "no sign"]),
    (["restore", "--job", "j", "--rank", "0", "--to", "/tmp/x", "--step", "05"], ["'05'"]),
    (["diff", "j", "01", "2"], ["'01'", "leading zero"]),
    (["verify", "j", "007"], ["'007'"]),
    (["rollback", "j", "05"], ["'05'"]),
    (["tag", "j", "05", "best"], ["'05'"]),
    (["forget", "j", "--step", "05"], ["'05'"]),
    (["import", "/tmp/x", "--job", "j", "--step", "05"], ["'05'"]),
    (["import", "/tmp/x", "--job", "j", "--step", "latest"], ["'latest'"]),
    # (found by a probe: ckptd's own options after a command got no hint, and an
    # age that is not one did not name its option)
    (["ls", "-v"], ["-v", "goes before the command", "`ckptd -v ls ...`"]),
    (["status", "--version"], ["--version", "`ckptd --version`"]),
    (["shm", "--clean", "--older-than", "abc"], ["--older-than", "'abc' is not an age"]),
]


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_one_or_two_lines_and_exit_2(
    args: list[str], needles: list[str], tmp_path: Path
) -> None:
    assert_short_usage_error(ckptd(*args, cwd=tmp_path), *needles)


def test_every_command_rejects_an_unknown_option_in_two_lines() -> None:
    from typer.main import get_command

    from ckptd.cli import app

    def paths(group: object, prefix: list[str]) -> list[list[str]]:
        out = []
        for name, cmd in getattr(group, "commands", {}).items():
            out += paths(cmd, [*prefix, name]) if hasattr(cmd, "commands") else [[*prefix, name]]
        return out

    commands = paths(get_command(app), [])
    assert len(commands) >= 8, commands
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: (c, ckptd(*c, "--no-such-option")), commands))
    for command, done in answers:
        assert_short_usage_error(done, "--no-such-option", " ".join(command))


def test_a_server_unreached_after_retries_says_to_start_one() -> None:
    """Retried, a refused connection said "GET ... failed after 5 attempts: All
    connection attempts failed" and nothing of what to do."""
    done = ckptd("ls", "--url", NOBODY, env={"CKPTD_RETRIES": "1"})
    assert_short_usage_error(done, "cannot reach http://127.0.0.1:9 (2 attempts)",
                             "ckptd serve --store", "CKPTD_URL")


def test_bad_setting_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    done = ckptd("serve", "--store", str(tmp_path / "s"), env={"CKPTD_PORT": "abc"})
    assert_short_usage_error(done, "CKPTD_PORT", "abc")


@pytest.mark.parametrize("setting", ["CKPTD_REQUEST_TIMEOUT=abc", "CKPTD_REQUEST_TIMEOUT=0",
                                     "CKPTD_RETRIES=-1", "CKPTD_CONNECT_TIMEOUT=nan",
                                     "CKPTD_CLUSTER_REFRESH=-3", "CKPTD_ANSWER_WITHIN=0"])
def test_a_bad_client_setting_from_the_environment_is_two_lines_naming_it(
        setting: str) -> None:
    """(Found by a probe: a traceback of 76 lines, or "failed after 0 attempts: None"
    for -1 retries, or a 0 s timeout blamed on the server.)"""
    name, value = setting.split("=")
    done = ckptd("ls", "--url", NOBODY, env={name: value})
    assert_short_usage_error(done, f"{name}={value!r}", "unset it for the default")


def test_s3_store_without_the_s3_extra_says_how_to_install_it(tmp_path: Path) -> None:
    # aiobotocore is installed here: hide it the way a missing package fails.
    code = ("import sys; sys.modules['aiobotocore'] = None; sys.argv[0] = 'ckptd'; "
            "from ckptd.cli import main; main()")
    done = ckptd("serve", "--store", "s3://bucket/prefix", code=code, cwd=tmp_path)
    assert_short_usage_error(done, "ckptd[s3]")


# -- reading commands never create a store; an unknown job is an error -------------------


@pytest.mark.parametrize("command", [["ls"], ["ls", "job"], ["verify", "job"],
                                     ["restore", "--job", "j", "--rank", "0", "--to", "{tmp}/to"],
                                     # (found by a probe: these created it, then said the
                                     # job had no committed checkpoint)
                                     ["export", "j", "--safetensors", "{tmp}/out"],
                                     ["export", "j", "--zarr", "{tmp}/out"],
                                     ["diff", "j", "1", "2"]])
def test_reading_commands_never_create_a_store(command: list[str], tmp_path: Path) -> None:
    where = tmp_path / "no" / "store"
    done = ckptd(*[a.format(tmp=tmp_path) for a in command], "--url", f"file://{where}")
    assert_short_usage_error(done, str(where))
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()
    assert not (tmp_path / "to").exists()


def _read_with_the_api(what: str, url: str, tmp_path: Path) -> object:
    from zarr.core.sync import sync

    from ckptd.client.dcp import Reader
    from ckptd.client.integrations.safetensors import export_safetensors
    from ckptd.client.restore import restore_command
    from ckptd.client.step_diff import diff_steps
    from ckptd.client.zarr_export import export_step
    from ckptd.zarr import CheckpointStore

    if what == "safetensors":
        return export_safetensors(url, "j", tmp_path / "out")
    if what == "zarr":
        return export_step(url, "j", tmp_path / "out")
    if what == "diff":
        return diff_steps(url, "j", 1, 2)
    if what == "view":
        return sync(CheckpointStore(url, "j").hierarchy())
    if what == "restore":
        return restore_command(url, "j", 0, tmp_path / "out", progress=False)
    return Reader(url, "j", 1).read_metadata()


@pytest.mark.parametrize("what", ["safetensors", "zarr", "diff", "view", "restore", "dcp"])
def test_reading_through_the_api_never_creates_a_store(what: str, tmp_path: Path) -> None:
    """(Found by a probe.) A mistyped file:// path is the typed NotFound naming it;
    the store was created and the answer was 'no committed checkpoint'."""
    from ckptd.errors import NotFound

    where = tmp_path / "no" / "store"
    with pytest.raises(NotFound) as info:
        _read_with_the_api(what, f"file://{where}", tmp_path)
    assert f"no store at {where}" in str(info.value), info.value
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["gc"], ["gc", "--dry-run"], ["scrub"], ["space"],
                                     ["forget", "job", "--keep-last", "1"],
                                     ["tag", "job", "1", "best"], ["untag", "job", "best"]])
def test_store_commands_never_create_a_store(command: list[str], tmp_path: Path) -> None:
    """A mistyped store path is refused at once (``gc`` created it and sat out its
    600 s grace period; the others created it and said the job was not there)."""
    where = tmp_path / "no" / "store"
    urls = (f"file://{where}", str(where))  # (a bare path too: found by review)
    for done in ckptd_each(*([*command, "--url", url] for url in urls)):
        assert_short_usage_error(done, str(where), "never creates a store")
    assert not (tmp_path / "no").exists()


def _save_one(url: str, job: str, shm: Path, torch_ones: int = 8) -> None:
    """Step 1 of ``job`` (one small tensor) in ``url``: saved here (a process of its
    own would import torch again, seconds of CPU for each store a test sets up)."""
    import torch

    from ckptd.client import Checkpointer

    with Checkpointer(url, job=job, shm_dir=str(shm)) as c:
        assert c.save(1, {"w": torch.ones(torch_ones)}).wait(60).state == "committed"


def test_unknown_job_is_exit_2_naming_the_jobs_there(
    server: ServerProcess, tmp_path: Path, shm: Path
) -> None:
    _save_one(server.url, "llm-7b", shm)
    # a file:// store says the same
    store = tmp_path / "files"
    _save_one(f"file://{store}", "other", shm)
    *unknown, ok, on_file = ckptd_each(["ls", "nojob", "--url", server.url],
                                       ["status", "nojob", "--url", server.url],
                                       ["ls", "llm-7b", "--url", server.url],
                                       ["ls", "nojob", "--url", f"file://{store}"])
    for done in unknown:
        assert_short_usage_error(done, "nojob", "llm-7b")
    assert ok.returncode == 0, ok.stderr
    assert_short_usage_error(on_file, "other")


def test_restore_into_a_directory_that_refuses_writes_names_it(tmp_path: Path,
                                                               shm: Path) -> None:
    """``ckptd restore --to DIR`` whose writes fail (the file size limit here, as a
    full disk or a quota would): one line that names DIR and says what to do, exit 2
    (before: "cannot write chunks/<id>", DIR unnamed)."""
    import resource
    import signal

    url = f"file://{tmp_path / 'store'}"
    _save_one(url, "big", shm, torch_ones=16384)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # below the 64 KiB chunk

    target = tmp_path / "into"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run([sys.executable, "-m", "ckptd", "restore", "--job", "big", "--rank",
                           "0", "--to", str(target), "--url", url], capture_output=True,
                          text=True, env={**env, "COLUMNS": "200"}, timeout=120,
                          preexec_fn=limit)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert f"cannot write into {target}:" in said and "restore elsewhere" in said, said
    assert "Traceback" not in said, said


def test_latest_is_a_step_where_the_help_says_default_latest(tmp_path: Path,
                                                              shm: Path) -> None:
    """(Found by a probe: "default: latest", but `latest` was refused with "Input
    should be a valid integer".)"""
    url = f"file://{tmp_path / 'store'}"
    _save_one(url, "j", shm)
    helped, exported, restored = ckptd_each(
        ["export", "--help"],
        ["export", "j", "latest", "--safetensors", str(tmp_path / "st"), "--url", url],
        ["restore", "--job", "j", "--rank", "0", "--to", str(tmp_path / "r"), "--step",
         "latest", "--url", url])
    help_text = " ".join(helped.stdout.split())
    assert "a new or empty directory" in help_text.lower(), help_text
    for done in (exported, restored):
        assert done.returncode == 0 and "step 1 of j" in done.stdout, done.stderr


def test_restore_to_takes_a_directory_or_a_file_url_and_leaves_none_on_failure(
        tmp_path: Path, shm: Path) -> None:
    """(Found by a probe.) ``--to file:///x`` made a directory named ``file:`` in the
    working directory and said ok; ``--to http://...`` one named ``http:``; and a
    restore that failed left the empty ``--to`` directory it had made."""
    done = ckptd("restore", "--job", "j", "--rank", "0", "--to", "http://host/x", "--url",
                 NOBODY, cwd=tmp_path)
    assert_short_usage_error(done, "--to", "http://host/x", "file:///path")
    assert not any(tmp_path.iterdir())
    store = tmp_path / "store"
    _save_one(f"file://{store}", "j", shm)
    into = tmp_path / "into"
    done = ckptd("restore", "--job", "nojob", "--rank", "0", "--to", f"file://{into}",
                 "--url", f"file://{store}", cwd=tmp_path)
    assert_short_usage_error(done, "nojob")
    assert not into.exists()
    done = ckptd("restore", "--job", "j", "--rank", "0", "--to", f"file://{into}", "--url",
                 f"file://{store}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (into / "jobs" / "j").is_dir() and not (tmp_path / "file:").exists()


def test_serve_on_a_port_in_use_says_so_in_a_line(tmp_path: Path) -> None:
    """(Found by a probe.) uvicorn's answer was nine lines of its log with the reason
    in the middle, and ``serve --check`` said it would serve."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for check in ([], ["--check"]):
            done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", port, *check)
            # (the words uvicorn used: a harness that picks another port on them, too)
            assert_short_usage_error(done, f"port {port} on 127.0.0.1: address already in "
                                     "use", "--port")


def test_a_missing_or_wrong_token_says_how_to_pass_one(token_server: ServerProcess) -> None:
    """(Found by a probe: "missing or wrong bearer token", nothing of what to do.)"""
    *refused, ok = ckptd_each(*(["ls", "--url", token_server.url, *extra]
                                for extra in ([], ["--token", "not-it"],
                                              ["--token", "s3cret-token"])))
    for done in refused:
        assert_short_usage_error(done, "[unauthorized]", "--token or CKPTD_TOKEN")
    assert ok.returncode == 0, ok.stderr


def test_forget_of_a_job_that_is_not_there_names_the_jobs_that_are(
        server: ServerProcess, tmp_path: Path, shm: Path) -> None:
    """(Found by a probe: "forgot 0 steps of nojob", exit 0, for a typo.)"""
    store = tmp_path / "files"
    _save_one(f"file://{store}", "real", shm)
    _save_one(server.url, "served", shm)

    def forget_both(url: str, there: str) -> tuple[subprocess.CompletedProcess[str], ...]:
        return (ckptd("forget", "nojob", "--keep-last", "1", "--url", url),
                ckptd("forget", there, "--keep-last", "1", "--url", url))

    stores = ((f"file://{store}", "real"), (server.url, "served"))
    with ThreadPoolExecutor(2) as pool:  # one store after the other, side by side
        answers = list(pool.map(lambda store: forget_both(*store), stores))
    for (_, there), (done, kept) in zip(stores, answers, strict=True):
        assert_short_usage_error(done, "no job 'nojob'", there)
        assert kept.returncode == 0 and "forgot 0 steps" in kept.stdout, kept.stderr


def test_reading_a_directory_that_is_no_store_says_so(tmp_path: Path, shm: Path) -> None:
    """(Found by a probe: the store's parent, given as --url, listed an empty table.)"""
    store = tmp_path / "store"
    _save_one(f"file://{store}", "j", shm)
    (tmp_path / "notes.txt").write_text("not a store")
    done, stored = ckptd_each(["ls", "--url", f"file://{tmp_path}"],
                              ["ls", "--url", f"file://{store}"])
    assert_short_usage_error(done, f"{tmp_path} is no ckptd store", "--url")
    assert stored.returncode == 0
    empty = tmp_path / "new"
    empty.mkdir()
    assert ckptd("ls", "--url", f"file://{empty}").returncode == 0  # (a new store)
