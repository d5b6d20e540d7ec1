"""``ckptd ls``, ``verify``, ``restore``, ``export``, ``import`` and ``diff`` on an
s3:// store, read (and, for import, written) in this process as ``gc`` and ``space``
read one, with no server (they said "unsupported URL"). Against moto's S3 server in
a process of its own; the store's objects are a file:// store's, uploaded."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("aiobotocore")
boto3 = pytest.importorskip("boto3")

from tests.cli_runs import ckptd as run_ckptd  # noqa: E402
from tests.integration.test_cli_mistakes import _save_one  # noqa: E402
from tests.moto_server import moto_server, s3_env  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

BUCKET = "ckptd-cli"
ROOT = Path(__file__).resolve().parents[2]


def aws_env() -> dict[str, str]:
    return s3_env(CKPTD_RETRIES="0", COLUMNS="200")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 with one bucket."""
    with moto_server("tests.cluster.moto_s3", BUCKET, aws_env(),
                     tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def s3_store(endpoint: str, tmp_path: Path, shm: Path) -> str:
    """An s3:// store holding step 1 of job llm-7b."""
    local = tmp_path / "files"
    _save_one(f"file://{local}", "llm-7b", shm)
    return _uploaded(local, endpoint)


def _uploaded(local: Path, endpoint: str) -> str:
    """The s3:// URL of a new prefix holding the file:// store ``local``'s objects."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    for path in local.rglob("*"):
        if path.is_file() and ".locks" not in path.parts:
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local)}",
                          Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}?endpoint={endpoint}"


def ckptd(*args: str, shm: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptd ARGS``; ``shm``: its staging root (import's pool, a restore's local tier)."""
    env = aws_env() | ({"CKPTD_SHM_DIR": str(shm)} if shm is not None else {})
    return run_ckptd(*args, environ=env, cwd=ROOT, timeout=120)


def test_ls_lists_an_s3_store(s3_store: str) -> None:
    jobs = ckptd("ls", "--url", s3_store)
    assert jobs.returncode == 0, jobs.stdout + jobs.stderr
    assert "llm-7b" in jobs.stdout
    steps = ckptd("ls", "llm-7b", "--url", s3_store)
    assert steps.returncode == 0, steps.stdout + steps.stderr
    assert "committed" in steps.stdout.lower(), steps.stdout


def test_verify_checks_an_s3_store(s3_store: str) -> None:
    done = ckptd("verify", "llm-7b", "--url", s3_store)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout and "llm-7b steps [1]" in done.stdout, done.stdout


def _short_error(done: subprocess.CompletedProcess[str], *said: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Traceback" not in out, out
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr
    for words in said:
        assert words in out, out


def test_restore_fills_a_directory_from_an_s3_store(s3_store: str, tmp_path: Path) -> None:
    """The chunks come from the s3:// store (an empty staging root: no local tier)
    and are the file:// store's, byte for byte."""
    into = tmp_path / "restored"
    done = ckptd("restore", "--job", "llm-7b", "--rank", "0", "--to", str(into),
                 "--url", s3_store, shm=tmp_path / "no-pools")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout and "step 1 of llm-7b rank 0" in done.stdout, done.stdout
    source = {p.name: p.read_bytes() for p in (tmp_path / "files" / "chunks").rglob("*")
              if p.is_file()}
    restored = {p.name: p.read_bytes() for p in (into / "chunks").rglob("*") if p.is_file()}
    assert source and restored == source


def test_export_safetensors_from_an_s3_store(s3_store: str, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "st"
    done = ckptd("export", "llm-7b", "--safetensors", str(out), "--url", s3_store)
    assert done.returncode == 0, done.stdout + done.stderr
    tensors: dict[str, torch.Tensor] = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    assert list(tensors) == ["w"] and torch.equal(tensors["w"], torch.ones(8))


def test_import_into_an_s3_store(s3_store: str, tmp_path: Path, shm: Path) -> None:
    """Committed into the s3:// store, then exported from it bitwise."""
    import torch
    from safetensors.torch import load_file

    source = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, source)
    done = ckptd("import", str(source), "--job", "imported", "--step", "3",
                 "--url", s3_store, shm=shm)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3 of imported" in done.stdout, done.stdout
    listed = ckptd("ls", "imported", "--url", s3_store)
    assert listed.returncode == 0 and "committed" in listed.stdout.lower(), listed.stdout
    out = tmp_path / "st"
    back = ckptd("export", "imported", "3", "--safetensors", str(out), "--url", s3_store)
    assert back.returncode == 0, back.stdout + back.stderr
    got = load_file(next(out.glob("*.safetensors")))
    assert torch.equal(got["w"], torch.arange(6, dtype=torch.float32))


def test_diff_between_two_steps_of_an_s3_store(endpoint: str, tmp_path: Path,
                                               shm: Path) -> None:
    """Step 2 changes w and keeps b: the chunk ids say which, --values reads w's
    chunks from the s3:// store for the difference."""
    import torch

    from ckptd.client import Checkpointer

    local = tmp_path / "files"
    with Checkpointer(f"file://{local}", job="llm-7b", shm_dir=str(shm)) as c:
        for step, w in ((1, torch.ones(8)), (2, torch.full((8,), 3.5))):
            assert c.save(step, {"w": w, "b": torch.zeros(4)}).wait(60).state == "committed"
    url = _uploaded(local, endpoint)
    done = ckptd("diff", "llm-7b", "1", "2", "--values", "--url", url)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines()
            if len(line.split()) > 2 and line.split()[1] in ("w", "b")}
    assert list(rows) == ["w"] and "changed" in rows["w"] and "2.5" in rows["w"], done.stdout
    assert "1 of 2 tensors differ between step 1 and 2" in done.stdout, done.stdout


@pytest.mark.parametrize("command", [
    ["restore", "--job", "llm-7b", "--rank", "0", "--to", "{tmp}/r"],
    ["export", "llm-7b", "--safetensors", "{tmp}/st"],
    ["import", "{tmp}/src.pt", "--job", "llm-7b", "--step", "1"],
    ["diff", "llm-7b", "1", "2"],
])
def test_a_bucket_that_is_not_there_is_two_lines(command: list[str], endpoint: str,
                                                  tmp_path: Path) -> None:
    """Named, with what to do; no store or directory is left behind."""
    import torch

    torch.save({"w": torch.zeros(2)}, tmp_path / "src.pt")
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    done = ckptd(*args, "--url", f"s3://no-such-bucket/p?endpoint={endpoint}",
                 shm=tmp_path / "shm")
    _short_error(done, "bucket 'no-such-bucket' does not exist", "create the bucket")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


@pytest.mark.parametrize("command", [
    ["ls"],
    ["verify", "llm-7b"],
    ["restore", "--job", "llm-7b", "--rank", "0", "--to", "{tmp}/r"],
    ["export", "llm-7b", "--safetensors", "{tmp}/st"],
    ["diff", "llm-7b", "1", "2"],
    ["gc"],
    ["tag", "llm-7b", "1", "best"],
])
def test_a_prefix_with_nothing_under_it_is_no_store(command: list[str], s3_store: str,
                                                     tmp_path: Path) -> None:
    """A mistyped prefix of a bucket that exists is named, as a mistyped directory
    is: it read as an empty store ("no committed checkpoint", "no jobs"), and ``tag``
    and ``gc`` went on to act on it."""
    typo = s3_store.replace(f"s3://{BUCKET}/", f"s3://{BUCKET}/x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    done = ckptd(*args, "--url", typo, shm=tmp_path / "shm")
    where = typo.split("?")[0]
    _short_error(done, f"no store at {where}/", "starts a store")
    assert not {"r", "st"} & {p.name for p in tmp_path.iterdir()}
    s3 = boto3.client("s3", endpoint_url=typo.split("endpoint=")[1],
                      aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix=where.split("/", 3)[3]).get(
        "KeyCount", 0) == 0


def test_scrub_refuses_a_replica_prefix_with_nothing_under_it(s3_store: str,
                                                              tmp_path: Path) -> None:
    """A mistyped replica prefix read as a replica that lacks every chunk: the corrupt
    one 'not repaired' and its step marked damaged (exit 1), with none corrupt not a
    word of it (exit 0). Now refused first (exit 2); the right prefix repairs it."""
    local = tmp_path / "files"  # (the store s3_store's objects were uploaded from)
    chunk = next(p for p in (local / "chunks").rglob("*") if p.is_file())
    chunk.chmod(0o644)
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    typo = s3_store.replace(f"s3://{BUCKET}/", f"s3://{BUCKET}/x")
    no_bucket = s3_store.replace(f"s3://{BUCKET}/", "s3://no-such-bucket/")
    refused = [ckptd("scrub", "--replica", replica, "--url", f"file://{local}")
               for replica in (typo, no_bucket)]
    _short_error(refused[0], "--replica", typo.split("?")[0], "no chunks are stored there")
    # A replica's bucket that is not there: named as --replica's, and never "create
    # the bucket" (an empty one would repair nothing either).
    _short_error(refused[1], "--replica", "bucket 'no-such-bucket' does not exist",
                 "name a copy of this store")
    assert "create the bucket" not in refused[1].stderr, refused[1].stderr
    assert all(d.returncode == 2 for d in refused)
    assert not (local / "jobs" / "llm-7b" / "damage").exists()
    done = ckptd("scrub", "--replica", s3_store, "--url", f"file://{local}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"repaired {chunk.name}" in done.stdout, done.stdout


def test_serve_check_of_a_bucket_that_is_not_there_gives_no_store_id_advice(
        endpoint: str) -> None:
    """(Found by a probe of the docs.) Before the bucket's own error, ``serve
    --check`` warned that the store's id did not read and advised removing
    cluster/store-id: there was nothing to remove."""
    done = ckptd("serve", "--check", "--port", "0", "--store",
                 f"s3://no-such-bucket/p?endpoint={endpoint}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no-such-bucket" in done.stderr and "store-id" not in done.stderr, done.stderr


def test_a_checkpointer_over_a_bucket_that_is_not_there_says_so_at_construction(
        endpoint: str, tmp_path: Path) -> None:
    """(Found by a probe: a direct s3:// Checkpointer over a missing bucket was made
    without a word; its first save failed in the background, with a traceback of two
    exceptions at close and aiohttp's 'Unclosed client session' at exit.) A new
    prefix of a bucket that is there is a new store, and is taken."""
    script = (
        "import sys\n"
        "from ckptd.client import Checkpointer\n"
        "from ckptd.errors import StoreError\n"
        "try:\n"
        f"    Checkpointer('s3://no-such-bucket/p?endpoint={endpoint}', 'j',\n"
        f"                 shm_dir={str(tmp_path)!r})\n"
        "except StoreError as exc:\n"
        "    print('refused:', exc.message)\n"
        f"with Checkpointer('s3://{BUCKET}/new-{uuid.uuid4().hex[:8]}?endpoint={endpoint}',\n"
        f"                  'j', shm_dir={str(tmp_path)!r}):\n"
        "    print('taken')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=aws_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "no-such-bucket" in done.stdout, done.stdout
    assert "does not exist" in done.stdout and "taken" in done.stdout, done.stdout
    assert "Unclosed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
