"""An S3 store that cannot be reached, or no credentials, are said with what to do
(found by a probe: 'Unable to locate credentials' and 'Could not connect to the
endpoint URL' alone, after tens of seconds of retries)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _check(url: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_"))}
    base.update(AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                AWS_EC2_METADATA_DISABLED="true", CKPTD_RETRIES="0", **env)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--store", url, "--check"],
                          capture_output=True, text=True, timeout=90, env=base)
    return done, time.monotonic() - start


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_credentials_says_how_to_give_them() -> None:
    done, _ = _check(f"s3://b/p?endpoint=http://127.0.0.1:{_closed_port()}")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "AWS_ACCESS_KEY_ID" in done.stderr and "AWS_PROFILE" in done.stderr, done.stderr


def test_an_endpoint_that_does_not_answer_is_named_with_the_way_to_give_one() -> None:
    port = _closed_port()
    done, took = _check(f"s3://b/p?endpoint=http://127.0.0.1:{port}",
                        AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"nothing answered at http://127.0.0.1:{port}" in done.stderr, done.stderr
    assert "?endpoint=" in done.stderr and took < 30, (took, done.stderr)
