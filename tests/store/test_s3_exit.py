"""A script on an s3:// store that ends on an exception, without closing the store:
its client is closed as ``asyncio.run`` ends, and the script's error is all it
prints (it printed aiohttp's "Unclosed client session" after it). On moto's S3."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("aiobotocore")
pytest.importorskip("moto.server")

from tests.moto_server import s3_env  # noqa: E402
from tests.store import test_s3  # noqa: E402

BUCKET = test_s3.BUCKET
endpoint = test_s3.endpoint  # moto's S3 server, this module's own

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_a_script_that_never_closes_its_store_prints_only_its_error(endpoint: str) -> None:
    script = textwrap.dedent(f"""
        import asyncio
        from ckptd.store import open_store

        async def main():
            store = open_store("s3://{BUCKET}/exit?endpoint={endpoint}")
            await store.put_if_absent("k", b"x")
            assert await store.exists("k")
            raise SystemExit("the script's own error")

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env=s3_env())
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == "the script's own error", done.stderr
