"""Issue 10, item 13: a heartbeat can not point restores anywhere, nor drop ranks.

Peer URLs must name the heartbeat's own source address (or a network the
operator allowed); peers authenticate with a per-job peer token from the server,
never with a client's server token; the world size changes only with a new
timeline, or once no rank of the old world is alive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.tokens import create_token
from tests.conftest import ServerProcess

ROOT = "root-token"


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("CKPTD_PEER_NETWORKS", "10.0.0.0/8")
    s = ServerProcess(store=tmp_path / "store", token=ROOT,
                      extra_args=["--tokens-file", str(tmp_path / "tokens.json")])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def beat(c: httpx.Client, job: str, rank: int, world: int, **body: object) -> httpx.Response:
    return c.post(f"/v1/jobs/{job}/ranks/{rank}/heartbeat", json={"world_size": world, **body})


def peer_urls(c: httpx.Client, job: str) -> dict[int, str | None]:
    return {r["rank"]: r["peer_url"] for r in c.get(f"/v1/jobs/{job}/ranks").json()["ranks"]}


def test_peer_urls_must_be_the_senders_own_address(srv: ServerProcess) -> None:
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
        for rank, url in enumerate((
            "http://169.254.169.254:80",  # a cloud metadata service
            "http://192.168.1.1:8080",  # another host of the sender's choice
            "http://metadata.google.internal:80",  # a name: DNS can change its answer
            "http://[::1]:80",  # loopback, but not the address it came from (127.0.0.1)
        )):
            r = beat(c, "j", rank, 8, peer_url=url)
            assert r.status_code == 200, r.text
            assert r.json()["peer_url_refused"], url
            assert peer_urls(c, "j")[rank] is None
        r = beat(c, "j", 5, 8, peer_url="http://127.0.0.1:4321")
        assert r.json()["peer_url_refused"] is None
        r = beat(c, "j", 6, 8, peer_url="http://10.1.2.3:4321")  # CKPTD_PEER_NETWORKS
        assert r.json()["peer_url_refused"] is None
        urls = peer_urls(c, "j")
        assert urls[5] == "http://127.0.0.1:4321" and urls[6] == "http://10.1.2.3:4321"


def test_peers_get_a_per_job_token_that_is_not_the_server_token(
    srv: ServerProcess, tmp_path: Path
) -> None:
    write_a = create_token(tmp_path / "tokens.json", "a", "write")[0]
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {write_a}"},
                      timeout=30) as c:
        token_a = beat(c, "a", 0, 1).json()["peer_token"]
        assert token_a == beat(c, "a", 0, 1).json()["peer_token"]
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30) as root:
        token_b = beat(root, "b", 0, 1).json()["peer_token"]
    assert token_a and token_b and token_a != token_b
    assert ROOT not in (token_a, token_b) and write_a not in (token_a, token_b)


def test_world_size_changes_only_with_a_new_timeline(srv: ServerProcess, tmp_path: Path) -> None:
    import torch

    from ckptd.client import Checkpointer

    with Checkpointer(srv.url, "w", token=ROOT, serve_peers=False, shm_dir=tmp_path / "shm",
                      heartbeat_interval=3600) as ckpt:
        ckpt.save(1, {"x": torch.ones(4)}).wait(60)
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
        assert beat(c, "w", 0, 2).status_code == 200  # rank 0 alone: nobody else to drop
        assert beat(c, "w", 1, 2).status_code == 200
        r = beat(c, "w", 0, 1)  # would drop live rank 1
        assert r.status_code == 409 and r.json()["code"] == "world_size_mismatch"
        assert sorted(peer_urls(c, "w")) == [0, 1]
        ranks = c.get("/v1/jobs/w/ranks").json()
        assert ranks["world_size"] == 2
        # A rollback starts a new timeline: the job may come back smaller.
        assert c.post("/v1/jobs/w/rollback", json={"step": 1, "reason": "t"}).status_code == 200
        r = beat(c, "w", 0, 1)
        assert r.status_code == 200, r.text
        assert sorted(peer_urls(c, "w")) == [0]


def test_a_read_only_token_cannot_say_goodbye_for_a_rank(srv: ServerProcess,
                                                         tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    write_j = create_token(tokens, "j", "write")[0]
    read_j = create_token(tokens, "j", "read")[0]
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {write_j}"},
                      timeout=30) as writer, \
            httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {read_j}"},
                         timeout=30) as reader:
        assert beat(writer, "j", 0, 1).status_code == 200
        r = reader.delete("/v1/jobs/j/ranks/0/heartbeat")
        assert r.status_code == 403, r.text
        assert r.json()["code"] == "forbidden"
        assert [x["state"] for x in reader.get("/v1/jobs/j/ranks").json()["ranks"]] == ["alive"]
        assert writer.delete("/v1/jobs/j/ranks/0/heartbeat").status_code == 204
        assert [x["state"] for x in reader.get("/v1/jobs/j/ranks").json()["ranks"]] == ["left"]
