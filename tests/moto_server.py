"""moto's S3 server for the tests that need an object store: a child process on
127.0.0.1 with one bucket, and an environment that holds dummy credentials and
nothing of the user's AWS or ckptd settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def s3_env(key_id: str = "testing", secret: str = "testing", **more: str) -> dict[str, str]:
    """This process's environment without AWS_* and CKPTD_*, with moto's credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_"))}
    env.update(AWS_ACCESS_KEY_ID=key_id, AWS_SECRET_ACCESS_KEY=secret,
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE="/nonexistent/aws-config",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials", **more)
    return env


@contextmanager
def moto_server(module: str, bucket: str, env: dict[str, str], log_dir: Path
                ) -> Iterator[str]:
    """Runs ``python -m module PORT BUCKET`` (tests.cluster.moto_s3, or
    tests.store.moto_presigned) and yields the endpoint it prints."""
    port = free_port()
    with open(log_dir / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, str(port), bucket], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("http://"):
            pytest.fail(f"moto did not start: {line!r}")
        yield line
    finally:
        proc.kill()
        proc.wait(timeout=15)
