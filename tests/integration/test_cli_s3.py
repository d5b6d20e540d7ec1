"""``ckptd ls`` and ``ckptd verify`` on an s3:// store, read directly as ``gc`` and
``space`` read one (they said "unsupported URL"). Against moto's S3 server in a
process of its own; the store's objects are a file:// store's, uploaded."""

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
    prefix = f"t{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    for path in local.rglob("*"):
        if path.is_file() and ".locks" not in path.parts:
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local)}",
                          Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}?endpoint={endpoint}"


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, env=aws_env(), cwd=ROOT, timeout=120)


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
