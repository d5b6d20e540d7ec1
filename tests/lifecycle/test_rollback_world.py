"""A step saved again after a rollback by a smaller world: manifests of the ended
timeline, of ranks past the new world size included, count as absent (found by
review: rank 0's commit said the step could never commit, then it committed)."""

from __future__ import annotations

import asyncio

from ckptd.repository import Repository
from ckptd.store.memory import MemoryStore
from ckptd.testing.manifests import rank_manifest, tensor_entry


def test_a_smaller_world_after_a_rollback_commits_without_a_false_refusal() -> None:
    async def scenario() -> tuple[str, str, str]:
        repo = Repository(MemoryStore())

        async def put(step: int, rank: int, world: int, epoch: int) -> None:
            e, chunks = tensor_entry("w", "float32", [16], seed=f"s{step}e{epoch}")
            for cid, data in chunks.items():
                await repo.put_chunk(cid, data)
            meta = {"epoch": epoch} if epoch else {}
            await repo.put_manifest(rank_manifest("j", step, rank, world, [e], meta=meta))

        for r in range(4):
            await put(1, r, 4, 0)
        assert (await repo.commit("j", 1)).state == "committed"
        await put(5, 3, 4, 0)  # step 5 was being saved by the world of 4 ...
        await repo.set_rollback("j", 1)  # ... when the job rolled back
        await put(5, 0, 3, 1)  # it comes back with 3 ranks and reaches step 5 again
        early = (await repo.commit("j", 5)).state
        await put(5, 1, 3, 1)
        middle = (await repo.commit("j", 5)).state
        await put(5, 2, 3, 1)
        last = (await repo.commit("j", 5)).state
        return early, middle, last

    assert asyncio.run(scenario()) == ("pending", "pending", "committed")
