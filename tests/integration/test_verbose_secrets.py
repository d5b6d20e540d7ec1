"""``ckptd -v`` shows ckptd's debug records, never the S3 library's: botocore logs
every request's headers at DEBUG, an STS session token and the request signature
among them (found by a probe: the token 166 times in one ``ckptd -v ls``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("aiobotocore")

from tests.moto_server import moto_server, s3_env  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BUCKET = "ckptd-verbose"
TOKEN = "SESSIONTOKEN-not-for-logs-0123456789"


def test_verbose_does_not_log_the_s3_credentials(tmp_path: Path) -> None:
    env = s3_env(AWS_SESSION_TOKEN=TOKEN)
    with moto_server("tests.cluster.moto_s3", BUCKET, env, tmp_path) as endpoint:
        done = subprocess.run(
            [sys.executable, "-m", "ckptd", "-v", "ls", "--url",
             f"s3://{BUCKET}/p?endpoint={endpoint}"],
            capture_output=True, text=True, env=env, timeout=90)
    said = done.stdout + done.stderr
    assert "DEBUG" in said and "no store at" in said, said  # (verbose, and it ran)
    assert TOKEN not in said and "Signature=" not in said, said[:3000]
    assert "Traceback" not in said
