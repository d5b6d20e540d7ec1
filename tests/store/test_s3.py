"""The S3 store against the store contract, on moto's real HTTP server, and what
only it does: conditional writes across clients, paginated listings, errors."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("aiobotocore")
boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402

from ckptd import knobs  # noqa: E402
from ckptd.errors import (  # noqa: E402
    CkptdError,
    InvalidName,
    InvalidRequest,
    NotFound,
    StoreError,
)
from ckptd.format import RankManifest, TensorEntry  # noqa: E402
from ckptd.hashing import chunk_id  # noqa: E402
from ckptd.repository import Repository  # noqa: E402
from ckptd.store import S3Store, open_store  # noqa: E402
from ckptd.store.base import Store  # noqa: E402
from ckptd.testing.moto_s3 import OneRequestAtATime  # noqa: E402
from ckptd.testing.store_conformance import StoreConformance  # noqa: E402
from tests.conftest import free_port  # noqa: E402

BUCKET = "ckptd-test"


_OneRequestAtATime = OneRequestAtATime  # (the tests' name for it)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, dummy credentials, and one bucket."""
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "CKPTD_RETRIES",
        ):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        werkzeug_log = logging.getLogger("werkzeug")  # logs every request at INFO
        level = werkzeug_log.level
        werkzeug_log.setLevel(logging.WARNING)
        server = moto_server.ThreadedMotoServer("127.0.0.1", free_port(), verbose=False)
        server.start()
        try:
            server._server.app = _OneRequestAtATime(server._server.app)
            host, port = server.get_host_and_port()
            url = f"http://{host}:{port}"
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
            yield url
        finally:
            server.stop()
            werkzeug_log.setLevel(level)


@pytest.fixture
def raw(endpoint: str) -> Any:
    """A plain boto3 client, to look at the bucket behind the store's back."""
    return boto3.client("s3", endpoint_url=endpoint)


@pytest.fixture
async def s3(endpoint: str) -> AsyncIterator[Callable[..., S3Store]]:
    """Makes S3Stores on one fresh prefix (each with its own client), closes them."""
    prefix = f"t/{uuid.uuid4().hex}"
    made: list[S3Store] = []

    def make(**kwargs: Any) -> S3Store:
        kwargs.setdefault("prefix", prefix)
        kwargs.setdefault("endpoint_url", endpoint)
        store = S3Store(BUCKET, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store(self, s3: Callable[..., S3Store]) -> Store:
        return s3()


# -- what only S3 does ------------------------------------------------------------------


def test_flags_and_describe(endpoint: str) -> None:
    store = S3Store(BUCKET, "/some/prefix/", endpoint_url=endpoint)
    assert store.durable is True
    assert store.cross_process_cas is True
    assert store.describe() == f"s3://{BUCKET}/some/prefix?endpoint={endpoint}"
    assert S3Store(BUCKET).describe() == f"s3://{BUCKET}/"


def test_open_store_urls(endpoint: str) -> None:
    store = open_store(f"s3://{BUCKET}/a/b?endpoint={endpoint}&region=eu-west-1")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url, store.region) == (
        BUCKET,
        "a/b",
        endpoint,
        "eu-west-1",
    )
    again = open_store(store.describe())
    assert isinstance(again, S3Store) and again.describe() == store.describe()
    bare = open_store(f"s3://{BUCKET}")
    assert isinstance(bare, S3Store)
    assert (bare.prefix, bare.endpoint_url, bare.region) == ("", None, None)
    for bad in ("s3:///prefix", f"s3://{BUCKET}/p?endpont=http://x", f"s3://{BUCKET}/a/../b"):
        with pytest.raises(InvalidRequest):
            open_store(bad)
    with pytest.raises(InvalidRequest):
        S3Store(BUCKET, page_size=1001)


async def test_keys_live_under_the_prefix(s3: Callable[..., S3Store], raw: Any) -> None:
    store = s3()
    await store.put_if_absent("chunks/ab/abcd", b"x")
    listed = raw.list_objects_v2(Bucket=BUCKET, Prefix=store.prefix + "/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{store.prefix}/chunks/ab/abcd"]
    other = s3(prefix=store.prefix + "-other")  # a prefix that extends this one's name
    assert not await other.exists("chunks/ab/abcd")
    await other.put_if_absent("chunks/ab/abcd", b"y")
    assert [k async for k in store.list_prefix("")] == ["chunks/ab/abcd"]
    assert await store.list_dir("") == ["chunks"]
    assert await store.get("chunks/ab/abcd") == b"x"


async def test_put_if_absent_race_between_clients(s3: Callable[..., S3Store]) -> None:
    a, b = s3(), s3()
    for round_ in range(10):
        key = f"chunks/00/{round_}"
        results = await asyncio.gather(
            a.put_if_absent(key, b"from a"), b.put_if_absent(key, b"from b")
        )
        assert sorted(results) == [False, True]
        assert await b.get(key) == (b"from a" if results[0] else b"from b")


async def test_cas_race_between_clients(s3: Callable[..., S3Store]) -> None:
    stores = [s3() for _ in range(4)]
    assert await stores[0].compare_and_swap("refs/latest", None, b"0")
    current = b"0"
    for round_ in range(1, 6):
        new = [f"{round_}/{i}".encode() for i in range(len(stores))]
        results = await asyncio.gather(
            *(
                s.compare_and_swap("refs/latest", current, n)
                for s, n in zip(stores, new, strict=True)
            )
        )
        assert sum(results) == 1
        current = new[results.index(True)]
        assert await stores[-1].get("refs/latest") == current


async def test_cas_with_a_stale_value_fails(s3: Callable[..., S3Store]) -> None:
    a, b = s3(), s3()
    assert await a.compare_and_swap("refs/latest", None, b"1")
    assert await b.compare_and_swap("refs/latest", b"1", b"2")
    assert await a.compare_and_swap("refs/latest", b"1", b"3") is False  # a's view is stale
    assert await a.get("refs/latest") == b"2"


async def test_cas_loses_when_replaced_between_its_read_and_its_write(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The If-Match write itself must lose, not only the comparison before it."""
    slow, fast = s3(), s3()
    assert await slow.compare_and_swap("refs/latest", None, b"1")
    read = slow._get_with_etag
    interleaved: list[bool] = []

    async def read_then_lose_the_race(key: str) -> tuple[bytes, str]:
        value = await read(key)
        interleaved.append(await fast.compare_and_swap(key, b"1", b"2"))
        return value

    monkeypatch.setattr(slow, "_get_with_etag", read_then_lose_the_race)
    assert await slow.compare_and_swap("refs/latest", b"1", b"3") is False
    assert interleaved == [True]
    assert await fast.get("refs/latest") == b"2"


async def test_cas_loses_when_deleted_between_its_read_and_its_write(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = s3(), s3()
    assert await store.compare_and_swap("refs/latest", None, b"1")
    read = store._get_with_etag

    async def read_then_delete(key: str) -> tuple[bytes, str]:
        value = await read(key)
        await other.delete(key)
        return value

    monkeypatch.setattr(store, "_get_with_etag", read_then_delete)
    assert await store.compare_and_swap("refs/latest", b"1", b"2") is False
    assert not await other.exists("refs/latest")


class ConflictOnPut:
    """Fault injection: the client's next ``times`` PutObject calls answer 409
    ConditionalRequestConflict (what S3 says while another conditional write of the
    key is in flight; moto never does), after running ``meanwhile``."""

    def __init__(self, client: Any, times: int, meanwhile: Callable[[], Any] | None = None):
        self.real = client.put_object
        self.times = times
        self.meanwhile = meanwhile
        self.calls = 0

    async def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.times:
            if self.meanwhile is not None:
                await self.meanwhile()
            raise ClientError(
                {
                    "Error": {"Code": "ConditionalRequestConflict", "Message": "in flight"},
                    "ResponseMetadata": {"HTTPStatusCode": 409},
                },
                "PutObject",
            )
        return await self.real(**kwargs)


async def test_a_conflict_on_create_is_retried_when_nothing_was_written(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(knobs, "retry_backoff", lambda: 0.001)
    store = s3()
    client = await store._client()
    fault = ConflictOnPut(client, times=2)
    monkeypatch.setattr(client, "put_object", fault)
    assert await store.put_if_absent("chunks/00/x", b"mine") is True
    assert fault.calls == 3
    assert await store.get("chunks/00/x") == b"mine"


async def test_a_conflict_on_create_with_the_other_write_landing_is_false(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = s3(), s3()
    client = await store._client()

    async def other_wins() -> None:
        assert await other.put_if_absent("chunks/00/x", b"theirs")

    fault = ConflictOnPut(client, times=1, meanwhile=other_wins)
    monkeypatch.setattr(client, "put_object", fault)
    assert await store.put_if_absent("chunks/00/x", b"mine") is False
    assert fault.calls == 1
    assert await store.get("chunks/00/x") == b"theirs"


async def test_a_conflict_that_never_ends_is_a_store_error(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(knobs, "retry_backoff", lambda: 0.001)
    store = s3()
    client = await store._client()
    monkeypatch.setattr(client, "put_object", ConflictOnPut(client, times=1000))
    with pytest.raises(StoreError):
        await store.put_if_absent("chunks/00/x", b"mine")
    assert not await store.exists("chunks/00/x")


async def test_a_conflict_on_swap_loses_the_swap(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = s3()
    assert await store.compare_and_swap("refs/latest", None, b"1")
    client = await store._client()
    fault = ConflictOnPut(client, times=1)
    monkeypatch.setattr(client, "put_object", fault)
    assert await store.compare_and_swap("refs/latest", b"1", b"2") is False
    assert await store.compare_and_swap("refs/latest", b"1", b"2") is True  # the caller retries
    assert fault.calls == 2


async def test_listings_across_many_pages(s3: Callable[..., S3Store]) -> None:
    store = s3(page_size=7)
    keys = [f"jobs/j/steps/{i}/commit.json" for i in range(25)]
    keys += [f"jobs/j/steps/{i}/ranks/0.json" for i in range(25)]
    keys += [f"jobs/j/steps/file-{i}" for i in range(10)]
    await asyncio.gather(*(store.put_if_absent(k, b"") for k in keys))
    assert sorted([k async for k in store.list_prefix("jobs/")]) == sorted(keys)
    expected = sorted([str(i) for i in range(25)] + [f"file-{i}" for i in range(10)])
    assert await store.list_dir("jobs/j/steps/") == expected
    assert await store.list_dir("jobs/j/steps") == expected  # the slash is implied
    assert await store.list_dir("jobs/j/steps/3/") == ["commit.json", "ranks"]


async def test_list_dir_past_s3s_page_limit(s3: Callable[..., S3Store], raw: Any) -> None:
    """More than 1000 names, S3's most per page, with the default page size."""
    store = s3()
    names = [f"{i:05d}" for i in range(1100)]
    # Seeded in moto's backend (same process) directly: 1100 PUTs over HTTP take ~10 s.
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for n in names:
        backend.put_object(BUCKET, f"{store.prefix}/chunks/{n}/x", b"")
    backend.put_object(BUCKET, f"{store.prefix}/chunks/loose", b"")
    page = raw.list_objects_v2(Bucket=BUCKET, Prefix=f"{store.prefix}/chunks/", Delimiter="/")
    assert page["IsTruncated"] is True  # so the store had to follow a continuation token
    assert await store.list_dir("chunks/") == sorted([*names, "loose"])
    assert len([k async for k in store.list_prefix("chunks/")]) == 1101


async def test_exists_many_is_bounded(
    s3: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = s3(concurrency=4)
    await store.put_if_absent("m/present", b"")
    exists = store.exists
    in_flight = peak = 0

    async def counted(key: str) -> bool:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await exists(key)
        finally:
            in_flight -= 1

    monkeypatch.setattr(store, "exists", counted)
    keys = [f"m/{i}" for i in range(30)] + ["m/present"]
    assert await store.exists_many(keys) == [False] * 30 + [True]
    assert peak == 4


async def test_not_found_is_a_key_error(s3: Callable[..., S3Store]) -> None:
    store = s3()
    with pytest.raises(KeyError) as info:
        await store.get("jobs/j/refs/latest")
    assert isinstance(info.value, NotFound) and info.value.detail["key"] == "jobs/j/refs/latest"
    await store.delete("jobs/j/refs/latest")  # absent: fine


async def test_a_missing_bucket_is_a_store_error(endpoint: str) -> None:
    store = S3Store("ckptd-no-such-bucket", endpoint_url=endpoint)
    try:
        for call in (store.get("k"), store.put_if_absent("k", b"x"), store.list_dir("")):
            with pytest.raises(StoreError) as info:
                await call
            assert isinstance(info.value, OSError) and isinstance(info.value, CkptdError)
            assert "does not exist" in str(info.value)
            assert info.value.detail["s3_code"] == "NoSuchBucket"
    finally:
        await store.close()


async def test_an_unreachable_endpoint_is_a_store_error(
    monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "0")
    store = S3Store(BUCKET, endpoint_url=f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(StoreError) as info:
            await store.exists("k")
        assert "HeadObject" in str(info.value) and "127.0.0.1" in str(info.value)
    finally:
        await store.close()


async def test_bad_keys_never_reach_s3(s3: Callable[..., S3Store]) -> None:
    store = s3(endpoint_url="http://127.0.0.1:9")  # nothing listens: a request would fail
    with pytest.raises(InvalidName):
        await store.get("a/../b")
    with pytest.raises(InvalidName):
        await store.list_dir("../")


async def test_one_store_on_two_event_loops(s3: Callable[..., S3Store]) -> None:
    """The server's loop and a background thread's loop may share a store."""
    store = s3()
    await store.put_if_absent("k", b"v")

    def in_another_loop() -> bytes:
        async def go() -> bytes:
            data = await store.get("k")
            await store.close()
            return data

        return asyncio.run(go())

    assert await asyncio.to_thread(in_another_loop) == b"v"
    assert await store.get("k") == b"v"
    await store.close()
    assert await store.exists("k")  # a closed store opens a new client when used again


# -- the repository over S3 ---------------------------------------------------------------

CHUNK = 4096


def rank_step(job: str, step: int, rank: int, world: int) -> tuple[RankManifest, dict[str, bytes]]:
    """A rank's manifest and chunks: a replicated 1 KiB tensor and its row of a
    sharded (world x 1024) float32 tensor."""
    shared = bytes([step % 256]) * 1024
    row = bytes([(step * 7 + rank) % 256]) * CHUNK
    chunks = {chunk_id(shared): shared, chunk_id(row): row}
    entries = [
        TensorEntry(
            name="bias",
            dtype="float32",
            placement="replicated",
            global_shape=[256],
            offsets=[0],
            shape=[256],
            nbytes=1024,
            chunks=[chunk_id(shared)],
        ),
        TensorEntry(
            name="weight",
            dtype="float32",
            placement="sharded",
            global_shape=[world, 1024],
            offsets=[rank, 0],
            shape=[1, 1024],
            nbytes=CHUNK,
            chunks=[chunk_id(row)],
        ),
    ]
    tree = {
        "dict": [
            ["bias", {"tensor": "bias"}],
            ["weight", {"tensor": "weight"}],
            ["step", {"value": step}],
        ]
    }
    manifest = RankManifest(
        job=job,
        step=step,
        rank=rank,
        world_size=world,
        chunk_size=CHUNK,
        entries=entries,
        tree=tree,
    )
    return manifest, chunks


async def test_repository_commits_over_s3(s3: Callable[..., S3Store]) -> None:
    repo = Repository(s3())
    job = "s3-smoke"
    assert await repo.latest(job) is None
    for step in (10, 20):
        for rank in range(2):
            manifest, chunks = rank_step(job, step, rank, 2)
            for cid in (await repo.missing_chunks(sorted(chunks))).missing:
                assert await repo.put_chunk(cid, chunks[cid])
            await repo.put_manifest(manifest)
            status = await repo.commit(job, step)
            assert status.state == ("pending" if rank == 0 else "committed")
        assert await repo.latest(job) == step
    assert await repo.list_jobs() == [job]
    assert [s.step for s in await repo.list_steps(job) if s.committed] == [10, 20]
    manifest = await repo.read_manifest(job, 20, 1)
    assert (
        await repo.get_chunk(manifest.entries[1].chunks[0])
        == rank_step(job, 20, 1, 2)[1][manifest.entries[1].chunks[0]]
    )
    await repo.close()


async def test_exists_many_runs_concurrency_requests_and_no_task_per_key(
    s3: Callable[..., S3Store]
) -> None:
    """A presence batch is 2,000 keys: it goes through `concurrency` workers, not a
    task (and a waiting coroutine) per key."""
    store = s3(concurrency=4)
    await store.put_if_absent("present", b"x")
    keys = ["present" if i % 50 == 0 else f"absent-{i}" for i in range(300)]
    in_flight = peak = tasks = 0
    head = store.exists

    async def watched(key: str) -> bool:
        nonlocal in_flight, peak, tasks
        in_flight += 1
        peak, tasks = max(peak, in_flight), max(tasks, len(asyncio.all_tasks()))
        try:
            return await head(key)
        finally:
            in_flight -= 1

    store.exists = watched  # type: ignore[method-assign]
    found = await store.exists_many(keys)
    assert found == [k == "present" for k in keys]
    assert peak == 4 and tasks <= 4 + 2, (peak, tasks)


class LostAnswers:
    """Fault injection: the first ``times`` PutObject answers are turned into a 500
    after the write reached the bucket (an answer lost on the way back), so
    botocore retries a write that had landed."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.lost = 0

    def __call__(self, response_dict: dict[str, Any], **_: Any) -> None:
        if self.lost < self.times and response_dict["status_code"] == 200:
            self.lost += 1
            response_dict["status_code"] = 500
            response_dict["body"] = (b"<Error><Code>InternalError</Code>"
                                     b"<Message>answer lost</Message></Error>")


@pytest.mark.parametrize("write", ["create", "swap"])
async def test_a_retried_write_that_had_landed_is_this_writes(
    s3: Callable[..., S3Store], write: str
) -> None:
    store = s3()
    if write == "swap":
        assert await store.compare_and_swap("jobs/j/refs/lease", None, b"old")
    client = await store._client()
    fault = LostAnswers(times=1)
    client.meta.events.register("before-parse.s3.PutObject", fault)
    try:
        if write == "create":
            won = await store.put_if_absent("jobs/j/refs/lease", b"token-mine")
        else:
            won = await store.compare_and_swap("jobs/j/refs/lease", b"old", b"token-mine")
    finally:
        client.meta.events.unregister("before-parse.s3.PutObject", fault)
    assert fault.lost == 1  # the first answer was lost, and botocore retried
    assert won is True
    assert await store.get("jobs/j/refs/lease") == b"token-mine"


async def test_a_retried_write_that_another_won_is_lost(s3: Callable[..., S3Store]) -> None:
    store, other = s3(), s3()
    client = await store._client()
    tries: list[int] = []

    async def other_lands_meanwhile(**_: Any) -> None:
        tries.append(1)
        if len(tries) == 1:  # the first try never arrives; the other writer's does
            assert await other.put_if_absent("jobs/j/refs/lease", b"token-theirs")
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    client.meta.events.register("before-send.s3.PutObject", other_lands_meanwhile)
    try:
        assert await store.put_if_absent("jobs/j/refs/lease", b"token-mine") is False
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", other_lands_meanwhile)
    assert len(tries) == 2  # retried, and the retry met the other's object
    assert await store.get("jobs/j/refs/lease") == b"token-theirs"


async def test_a_chunk_another_writer_stored_during_a_retry_is_not_this_writes(
    s3: Callable[..., S3Store]
) -> None:
    """A chunk's bytes are its id: two replicas storing the same chunk at once send
    the same bytes, so finding them after a retry does not make the write this
    call's (each would count the chunk as stored by itself)."""
    store, other = s3(), s3()
    client = await store._client()
    tries: list[int] = []
    key, body = "chunks/ab/" + "ab" * 32, b"the same bytes from anyone"

    async def other_lands_meanwhile(**_: Any) -> None:
        tries.append(1)
        if len(tries) == 1:  # the first try never arrives; the other replica's does
            assert await other.put_content(key, body)
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    client.meta.events.register("before-send.s3.PutObject", other_lands_meanwhile)
    try:
        assert await store.put_content(key, body) is False
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", other_lands_meanwhile)
    assert len(tries) == 2  # retried, and the retry met the other's object
    assert await store.get(key) == body
