"""Issue 20, item 2: a store that cannot write conditionally is refused.

moto's S3 server (one request at a time: S3's atomic conditional writes) behind
a front that drops ``If-None-Match`` and ``If-Match``: ``ckptd serve --check``
and ``ckptd serve`` refuse it in a line or two naming the store and what it
lacks; moto itself passes. ``--single-writer`` serves it, checking the
conditions in the server's process, and is refused beside replicas."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiobotocore")
pytest.importorskip("moto.server")

import torch  # noqa: E402

from ckptd.client import Checkpointer  # noqa: E402
from ckptd.errors import StoreError  # noqa: E402
from ckptd.store import S3Store  # noqa: E402
from ckptd.store.probe import conditional_write_gaps  # noqa: E402
from ckptd.store.single_writer import SingleWriterStore  # noqa: E402
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess, free_port  # noqa: E402
from tests.hostile.s3_front import DroppingFront  # noqa: E402

BUCKET = "conditions"
ROOT = Path(__file__).resolve().parents[2]


def s3_env() -> dict[str, str]:
    """Dummy credentials for moto, and nothing of the user's AWS or ckptd setup."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_"))}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    return env


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    with open(tmp_path_factory.mktemp("moto") / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.moto_s3", str(port), BUCKET],
                                cwd=ROOT, env=s3_env(), stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().decode().strip()
        assert url.startswith("http://"), url
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def front(moto: str) -> Iterator[DroppingFront]:
    f = DroppingFront(moto)
    try:
        yield f
    finally:
        f.close()


def store_url(endpoint: str) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}?endpoint={endpoint}"


def ckptd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_ckptd(*args, environ={**s3_env(), "COLUMNS": "200"}, timeout=timeout)


def test_check_refuses_a_front_that_drops_conditions(front: DroppingFront) -> None:
    url = store_url(front.url)
    done = ckptd("serve", "--check", "--store", url)
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2
    assert f"store {url} cannot write conditionally" in said
    assert "If-None-Match is ignored" in said and "If-Match is ignored" in said
    assert "--single-writer" in said
    assert front.dropped > 0


def test_check_passes_moto_itself(moto: str) -> None:
    url = store_url(moto)
    done = ckptd("serve", "--check", "--store", url)
    assert done.returncode == 0, done.stderr
    assert f"ok: would serve {url}" in " ".join(done.stdout.split())


def test_serve_refuses_to_start(front: DroppingFront, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "serve", "--store", store_url(front.url), "--port",
         str(free_port()), "--member-leases"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s3_env())
    try:
        out, _ = proc.communicate(timeout=60)  # today's server serves it: never exits
    finally:
        proc.kill()
    assert proc.returncode == 2 and "cannot write conditionally" in out, out


async def _racing_creates(store: S3Store | SingleWriterStore) -> int:
    key = f"race/{uuid.uuid4().hex}"
    won = await asyncio.gather(*(store.put_if_absent(key, b"%d" % i) for i in range(8)))
    return sum(won)


def test_the_probe_and_the_single_writer_store(front: DroppingFront, moto: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)

    async def go() -> None:
        prefix = uuid.uuid4().hex
        behind = S3Store(BUCKET, prefix, endpoint_url=front.url)
        direct = S3Store(BUCKET, prefix, endpoint_url=moto)
        try:
            assert await _racing_creates(behind) > 1  # the front really lets all win
            gaps = " ".join(await conditional_write_gaps(behind))
            # Both refusals and the racing creates, always; the racing swaps nearly so
            # (a swap that reads after another's write loses by its own comparison).
            for lack in ("If-None-Match is ignored", "If-Match is ignored",
                         "8 of 8 concurrent put-if-absents"):
                assert lack in gaps, gaps
            assert await conditional_write_gaps(direct) == []
            single = SingleWriterStore(behind)
            assert await _racing_creates(single) == 1
            assert await conditional_write_gaps(single) == []
            assert not [k async for k in direct.list_prefix("cluster/probes/")]
        finally:
            await behind.close()
            await direct.close()

    asyncio.run(go())


def test_single_writer_serves_and_commits(front: DroppingFront, tmp_path: Path) -> None:
    url = store_url(front.url)
    refused = ckptd("serve", "--check", "--single-writer", "--member-leases", "--store", url)
    assert refused.returncode == 2 and "--single-writer" in refused.stderr, refused.stderr
    srv = ServerProcess(store=url, extra_args=["--single-writer"], log_dir=tmp_path,
                        env=s3_env())
    srv.start()
    try:
        assert "serving it as its single writer" in " ".join(srv.log().split())
        with Checkpointer(srv.url, "solo", chunk_size=4096, serve_peers=False,
                          heartbeat_interval=0) as ckpt:
            for step in (1, 2):
                assert ckpt.save(step, {"w": torch.full((64,), float(step))}).wait(
                    timeout=60).state == "committed"
            state = {"w": torch.zeros(64)}
            assert ckpt.restore(state).step == 2 and float(state["w"][0]) == 2.0
    finally:
        srv.stop()


def test_writers_using_the_store_directly_are_refused(front: DroppingFront, moto: str,
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No `ckptd serve` probed a store a rank or the CLI writes directly: its first
    conditional write does, and a store that drops the conditions is refused there,
    in a line or two, before any ref or commit record is written."""
    for name, value in s3_env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    source = tmp_path / "src.pt"
    torch.save({"w": torch.arange(4.0)}, source)
    url = store_url(front.url)
    done = ckptd("import", str(source), "--job", "direct", "--step", "1", "--url", url)
    assert done.returncode != 0, done.stdout
    said = " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2
    assert f"store {url} cannot write conditionally" in said and "--single-writer" in said
    collected = ckptd("gc", "--url", url)  # (the lifecycle commands open it alike)
    assert collected.returncode != 0 and "cannot write conditionally" in collected.stderr, (
        collected.stdout + collected.stderr)
    with (
        Checkpointer(url, "direct", chunk_size=4096, shm_dir=tmp_path / "shm",
                     serve_peers=False, heartbeat_interval=0) as ckpt,
        pytest.raises(StoreError, match="cannot write conditionally"),
    ):
        ckpt.save(1, {"w": torch.ones(64)}).wait(timeout=60)
    # Nothing committed: not a record, not a ref (the probe's own objects went too).
    behind = moto_keys(moto, url.split("/")[3].split("?")[0])
    assert not [k for k in behind if "/refs/" in k or k.endswith("/commit.json")], behind
    assert not [k for k in behind if "cluster/probes/" in k], behind
    # The store itself writes conditionally: the same, straight to moto, commits.
    with Checkpointer(store_url(moto), "direct", chunk_size=4096, shm_dir=tmp_path / "shm2",
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(64)}).wait(timeout=60).state == "committed"


def moto_keys(endpoint: str, prefix: str) -> list[str]:
    async def go() -> list[str]:
        store = S3Store(BUCKET, prefix, endpoint_url=endpoint)
        try:
            return [k async for k in store.list_prefix("")]
        finally:
            await store.close()

    return asyncio.run(go())
