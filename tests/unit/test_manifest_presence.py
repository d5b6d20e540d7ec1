"""A manifest's put and commit ask the store about its chunks a batch at a time:
the keys (and a local store's paths) of 100,000 chunks, made in one go on the
event loop, held it for about a second (issue 10 item 2)."""

from __future__ import annotations

import pytest

from ckptd import repository
from ckptd.errors import MissingChunks
from ckptd.format import RankManifest, TensorEntry, chunk_key
from ckptd.hashing import chunk_id
from ckptd.knobs import MIN_CHUNK_SIZE
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.faults import FaultyStore
from ckptd.testing.manifests import flat_tree

CHUNKS = 25


def _manifest(step: int, datas: list[bytes]) -> RankManifest:
    entries = [TensorEntry(name=f"e{i}", dtype="uint8", placement="replicated",
                           global_shape=[len(d)], offsets=[0], shape=[len(d)],
                           nbytes=len(d), chunks=[chunk_id(d)]) for i, d in enumerate(datas)]
    return RankManifest(job="job", step=step, rank=0, world_size=1, chunk_size=MIN_CHUNK_SIZE,
                        entries=entries, tree=flat_tree(e.name for e in entries))


async def test_chunks_are_asked_about_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repository, "PRESENCE_BATCH", 10, raising=False)
    store = FaultyStore(MemoryStore())
    repo = Repository(store)
    datas = [i.to_bytes(8, "little") * 8 for i in range(CHUNKS)]
    for d in datas:
        await store.put_if_absent(chunk_key(chunk_id(d)), d)
    await repo.put_manifest(_manifest(1, datas))
    assert store.calls["exists_many"] == 3  # 10 + 10 + 5
    assert (await repo.commit("job", 1)).state == "committed"
    # The commit asks about the chunks again in 3 batches, then whether the step's
    # manifests are all still there (retention may remove a step as it commits).
    assert store.calls["exists_many"] == 7
    manifests_asked = [key for op, key in store.log if op == "exists_many"][-1:]
    assert manifests_asked == ["jobs/job/steps/1/ranks/0.json"]
    asked = [key for op, key in store.log if op == "exists_many"]
    assert sorted(asked[:CHUNKS]) == sorted(chunk_key(chunk_id(d)) for d in datas)

    # A missing chunk is still found and named, whichever batch it falls in.
    await store.delete(chunk_key(chunk_id(datas[-1])))
    with pytest.raises(MissingChunks) as info:
        await repo.put_manifest(_manifest(2, datas))
    assert info.value.detail["ids"] == [chunk_id(datas[-1])]
