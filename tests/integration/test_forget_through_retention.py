"""``ckptd forget JOB --keep-last N`` through a server with a retention file: N
replaces the file's keep_last and its other rules still hold, and the output says
which steps those rules kept. (Found by an operator's probe: ``--keep-last 1 --dry-run``
kept steps 0, 10 and 20 as "every 10th" and forgot nothing, while the same on the
store forgot them, and nothing said the server's file was at work.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.cli_runs import ckptd
from tests.conftest import ServerProcess

JOB = "llm-7b"
STEPS = range(0, 30, 5)  # 0, 5, ..., 25


async def _fill(root: Path) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    try:
        for step in STEPS:
            for manifest, chunks in demo_step(JOB, step, 1):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit(JOB, step)).state == "committed"
    finally:
        await repo.close()


def _said(text: str) -> str:
    return " ".join(text.split())


def test_keep_last_through_a_server_says_what_its_retention_kept(tmp_path: Path) -> None:
    root = tmp_path / "store"
    asyncio.run(_fill(root))
    policy = tmp_path / "retention.toml"
    policy.write_text(f"[retention]\nkeep_last = 3\n\n[retention.jobs.{JOB}]\n"
                      "keep_last = 2\nkeep_every = 10\n")
    # (The server applies its retention as it starts: 5 and 15 go, 0, 10, 20, 25 stay.)
    srv = ServerProcess(store=root, extra_args=["--retention", str(policy)])
    srv.start()
    try:
        done = ckptd("forget", JOB, "--keep-last", "1", "--dry-run", "--url", srv.url)
    finally:
        srv.stop()
    said = _said(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kept by the server's retention (keep_every = 10): 0, 10, 20" in said, said
    assert "would forget 0 steps of llm-7b: []" in said, said
    # The same file on the store says it the same way.
    done = ckptd("forget", JOB, "--keep-last", "1", "--dry-run", "--retention", str(policy),
                 "--url", str(root))
    said = _said(done.stdout)
    assert f"kept by the retention of {policy} (keep_every = 10): 0, 10, 20" in said, said
    assert "would forget 0 steps of llm-7b: []" in said, said
    # With no file, only what --keep-last keeps (and latest): no such line.
    done = ckptd("forget", JOB, "--keep-last", "1", "--dry-run", "--url", str(root))
    said = _said(done.stdout)
    assert "kept by" not in said and "would forget 3 steps of llm-7b: [0, 10, 20]" \
        in said, said


def test_forget_help_says_a_servers_other_rules_still_hold() -> None:
    done = ckptd("forget", "--help")
    said = _said(done.stdout)
    assert "N replaces its keep_last and its other rules still hold" in said, said
