"""Replicas over one S3 bucket (moto's server), with clients routing each chunk to
its home replica and each job to its home: commits happen once, chunk traffic
spreads evenly, each chunk is stored once, any replica restores bitwise."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.checkpointer import Shard
from ckptd.client.transport import open_transport
from ckptd.cluster import chunk_key, home, job_key
from tests.cluster.conftest import BUCKET, Cluster, PortTaken

pytestmark = pytest.mark.slow

CHUNK = 4096  # 640 chunks over 5 steps: 20% of even is > 3.5 sigma of a random spread
ROWS, COLS = 480, 256  # a shard of 480 x 256 bf16: 240 KiB, 60 chunks


def rank_state(rank: int, step: int, *, dp: int = 2) -> tuple[dict[str, Any], dict[str, Shard]]:
    """Rank ``rank`` of a world of 2 shards x ``dp`` data-parallel replicas: its
    shard of ``w`` (identical across replicas), and ``b``, replicated everywhere."""
    shard = rank // dp
    g = torch.Generator().manual_seed(1000 * step + shard)
    w = torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)
    b = torch.randn(4 * CHUNK // 4, generator=torch.Generator().manual_seed(step))
    return {"w": w, "b": b, "step": step}, {"w": Shard((2 * ROWS, COLS), (shard * ROWS, 0))}


def static_cluster(store: str, workdir: Path, n: int, env: dict[str, str]) -> Cluster:
    """``n`` replicas told of each other by --peers (ports picked anew when another
    process took one before its replica bound it)."""
    for _ in range(3):
        cluster = Cluster(store, workdir, [], env)
        for _ in range(n):
            cluster.add(start=False)
        for replica in cluster.replicas:
            replica.args = ["--peers", cluster.urls]
            replica.popen()
        try:
            for replica in cluster.replicas:
                replica.wait_ready()
            return cluster
        except PortTaken:
            cluster.stop()
    raise AssertionError("no free ports for the replicas")


def save_all(
    ckpts: list[Checkpointer], step: int, timeout: float = 120, dp: int = 2
) -> list[Any]:
    handles: list[Any] = [None] * len(ckpts)
    start = threading.Barrier(len(ckpts))

    def save(r: int) -> None:
        state, shards = rank_state(r, step, dp=dp)
        start.wait()
        handles[r] = ckpts[r].save(step, state, shards=shards)

    threads = [threading.Thread(target=save, args=(r,)) for r in range(len(ckpts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [h.wait(timeout=timeout) for h in handles]


def referenced_chunks(url: str, job: str, steps: list[int], world: int) -> set[str]:
    async def read() -> set[str]:
        transport = open_transport(url)
        try:
            ids: set[str] = set()
            for step in steps:
                for rank in range(world):
                    ids |= set((await transport.read_manifest(job, step, rank)).chunk_ids())
            return ids
        finally:
            await transport.close()
    return asyncio.run(read())


def s3_keys(endpoint: str, store: str, under: str) -> list[str]:
    prefix = store.split("?")[0].removeprefix(f"s3://{BUCKET}/") + "/" + under
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def checkpointers(urls: str, job: str, world: int, shm: Path) -> list[Checkpointer]:
    return [Checkpointer(urls, job, rank=r, world_size=world, chunk_size=CHUNK,
                         serve_peers=False, shm_dir=shm, timeout=120) for r in range(world)]


def test_three_replicas_one_bucket_four_ranks_five_steps(
    s3_store: str, moto_endpoint: str, tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = static_cluster(s3_store, tmp_path, 3, {})
    job, world, steps = "scale", 4, [1, 2, 3, 4, 5]
    try:
        # Each rank is given one replica only: it learns the others from /v1/cluster.
        ckpts = [Checkpointer(cluster.replicas[r % 3].url, job, rank=r, world_size=world,
                              chunk_size=CHUNK, serve_peers=False, shm_dir=shm, timeout=120)
                 for r in range(world)]
        try:
            for step in steps:
                results = save_all(ckpts, step)
                assert "committed" in {r.state for r in results}, results
        finally:
            for ckpt in ckpts:
                ckpt.close()

        ids = referenced_chunks(cluster.replicas[0].url, job, steps, world)
        # Every step committed, once: one commit record each, and `latest` is the last.
        commits = s3_keys(moto_endpoint, s3_store, f"jobs/{job}/steps/")
        assert sorted(k.rsplit("/", 2)[-2] for k in commits if k.endswith("/commit.json")) \
            == sorted(str(s) for s in steps)
        # Each chunk stored once, by the replica that is its home.
        stored = [r.metric("ckptd_chunks_stored_total") for r in cluster.replicas]
        assert sum(stored) == len(ids) == len(s3_keys(moto_endpoint, s3_store, "chunks/"))
        urls = [r.url for r in cluster.replicas]
        for replica, count in zip(cluster.replicas, stored, strict=True):
            assert count == sum(1 for c in ids if home(chunk_key(c), urls) == replica.url)
        # Data-parallel replicas' claims met at the chunk's home: each sent once, and
        # the uploads spread within 20% of even.
        uploads = [r.metric("ckptd_chunk_upload_seconds_count") for r in cluster.replicas]
        assert sum(uploads) == len(ids), uploads
        even = len(ids) / 3
        assert all(abs(u - even) <= 0.2 * even for u in uploads), (uploads, even)
        # The job's heartbeats and commits went to the job's home only.
        beats = [r.metric("ckptd_heartbeats_total") for r in cluster.replicas]
        job_home = urls.index(home(job_key(job), urls))
        assert beats[job_home] > 0 and sum(beats) == beats[job_home], beats

        # Any replica restores every rank bitwise (the client seeded with it alone,
        # learning no others, so every call goes to that one replica).
        monkeypatch.setenv("CKPTD_CLUSTER_REFRESH", "0")
        for replica in cluster.replicas:
            for r in range(world):
                expected, shards = rank_state(r, steps[-1])
                with Checkpointer(replica.url, job, rank=r, world_size=world,
                                  chunk_size=CHUNK, serve_peers=False, shm_dir=shm) as ckpt:
                    target = {"w": torch.zeros_like(expected["w"]),
                              "b": torch.zeros_like(expected["b"]), "step": 0}
                    ckpt.restore(target, shards=shards, tiers=["store"])
                assert torch.equal(target["w"].view(torch.int16),
                                   expected["w"].view(torch.int16))
                assert torch.equal(target["b"], expected["b"]) and target["step"] == 5
    finally:
        cluster.stop()
