"""The client's view of the replicas: down members go last in every key's order
(the same as leaving them out, so every client agrees on the next home), a
membership answer replaces the seeds, and status merges each job from its home."""

from __future__ import annotations

import os

from ckptd.client.routing import Members, merge_overviews
from ckptd.cluster import chunk_key, home, job_key, rank_members

URLS = [f"http://10.0.0.{i}:8470" for i in range(4)]


def test_a_down_member_goes_last_and_its_keys_go_to_their_next_home() -> None:
    members = Members(URLS, refresh_s=10)
    gone = URLS[1]
    members.mark_down(gone, ConnectionRefusedError())
    assert members.live() == [u for u in URLS if u != gone]
    keys = [chunk_key(os.urandom(32).hex()) for _ in range(300)]
    for key in keys:
        order = members.order(key)
        assert order[-1] == gone
        assert order[:-1] == rank_members(key, [u for u in URLS if u != gone])
    for url, group in members.homes(keys).items():
        assert url != gone
        assert all(members.order(k)[0] == url for k in group)


def test_cluster_answers_replace_the_seeds_unless_single() -> None:
    members = Members(URLS[:1], refresh_s=10)
    members.update({"mode": "single", "self_url": "http://0.0.0.0:8470",
                    "members": [{"id": "x", "url": "http://0.0.0.0:8470"}]})
    assert members.urls == URLS[:1]  # a lone server's own idea of its URL is not used
    members.update({"mode": "static", "self_url": URLS[0],
                    "members": [{"id": str(i), "url": u} for i, u in enumerate(URLS)]})
    assert members.urls == URLS
    assert not members.refresh_due()
    assert not Members(URLS, refresh_s=0).refresh_due()  # 0: the URLs given only


def test_status_takes_each_job_from_its_home() -> None:
    urls = URLS[:2]
    jobs = [f"j{i}" for i in range(10)]
    views = [{"version": "x", "jobs": [{"job": j, "ranks": [url]} for j in jobs]}
             for url in urls]
    merged = merge_overviews(views, urls)
    assert [j["job"] for j in merged["jobs"]] == sorted(jobs)
    for job in merged["jobs"]:
        assert job["ranks"] == [home(job_key(job["job"]), urls)]


async def test_the_heartbeat_of_a_checkpointer_routes_over_the_same_replicas() -> None:
    from ckptd.client.health.heartbeat import Heartbeat
    from ckptd.client.transport import HttpTransport

    transport = HttpTransport(",".join(URLS[:2]))
    try:
        # The checkpointer hands transport.url to its heartbeat: every replica given,
        # not only the first (which may be the one that is down).
        hb = Heartbeat(transport.url, "j", 0, 1)
        assert hb.transport.members is transport.members
        assert transport.members.seeds == URLS[:2]
    finally:
        await transport.close()
