"""A store in an S3 bucket (or any S3-compatible object store: MinIO, R2, Ceph).

Objects are created with a conditional ``PutObject`` (``If-None-Match: *``), so
create-if-absent holds across processes and hosts; refs change by reading the
object's ETag and writing with ``If-Match: <etag>``, so a compare-and-swap loses
cleanly (412 or 409) against a concurrent writer instead of overwriting it. Both
need a service with conditional writes (AWS S3 since 2024, MinIO, recent moto).

Endpoint, region and credentials come from the arguments or from botocore's usual
sources (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``, ...)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.exceptions import BotoCoreError, ClientError
from botocore.handlers import add_expect_header

from ckptd import knobs
from ckptd.errors import CkptdError, InvalidRequest, NotFound, StoreError
from ckptd.store.base import ObjectInfo, Store, check_key, check_prefix
from ckptd.store.s3_advice import answer_hint, aws_setting, connection_hint, never_retried
from ckptd.store.s3_presign import SigningKey, presign_get

log = logging.getLogger(__name__)

# Error codes S3 (and its look-alikes) return for "no such object". HeadObject has
# no body, so botocore can only give the status as the code.
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
# A conditional write whose condition did not hold.
_PRECONDITION_FAILED = frozenset({"PreconditionFailed", "412"})
# Another conditional write (or a delete) of the same key was in flight; AWS asks
# the caller to retry.
_CONFLICT = frozenset({"ConditionalRequestConflict", "OperationAborted", "409"})
_CONFLICT_ATTEMPTS = 5
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}|arn:[^/]+")
# Set while a store's own probe runs (its writes, and the tasks it gathers them in).
_IN_PROBE: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptd_s3_probe",
                                                                default=False)


class _Conflict(Exception):
    """A conditional PutObject met a concurrent one (409); never leaves this module."""


_loader_lock = threading.Lock()
_loader: Any = None


def _new_session() -> AioSession:
    """A botocore session whose parsed service models are shared with every other
    store's: parsing S3's model costs a few hundred milliseconds per session."""
    global _loader
    session = get_session()
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _loader)
    return session


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class _LoopClient:
    """An open S3 client and what closes it; aiohttp binds a client to one loop."""

    def __init__(self, client: Any, stack: AsyncExitStack) -> None:
        self.client = client
        self.closing = _closing(stack)


async def _closing(stack: AsyncExitStack) -> AsyncGenerator[None, None]:
    """Open while its client is. A loop's shutdown (``asyncio.run``'s end) closes the
    async generators still open: so the client of a store nobody closed (a script
    ended by an exception) too, which aiohttp reported as "Unclosed client session"."""
    try:
        yield
    finally:
        await stack.aclose()


def _opened(task: asyncio.Task[_LoopClient]) -> _LoopClient | None:
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    return None


class S3Store(Store):
    durable = True
    cross_process_cas = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client_kwargs: dict[str, Any] | None = None,
        page_size: int = 1000,
        concurrency: int = 32,
    ) -> None:
        if not _BUCKET.fullmatch(bucket):  # (never botocore's regex dump, nor "user:pw@")
            raise InvalidRequest(f"bad S3 bucket name {bucket.rpartition('@')[2]!r}: letters, "
                                 "digits, '.', '-' and '_' (s3://bucket/prefix)")
        if endpoint_url is not None and "@" in urlsplit(endpoint_url).netloc:
            raise InvalidRequest("an S3 endpoint takes no user:password@: credentials go in "
                                 "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if not 1 <= page_size <= 1000:
            raise InvalidRequest(f"page_size {page_size} must be in [1, 1000] (S3's own limit)")
        if concurrency < 1:
            raise InvalidRequest(f"concurrency {concurrency} must be at least 1")
        self.bucket = bucket
        self.prefix = check_key(prefix.strip("/")) if prefix.strip("/") else ""
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.page_size = page_size
        self.concurrency = concurrency
        self._client_kwargs = dict(client_kwargs or {})
        self._session: AioSession | None = None
        # One client per event loop: the store may be shared by the server's loop and
        # a background thread's loop, and an aiohttp session must not cross loops.
        self._lock = threading.Lock()
        self._clients: dict[asyncio.AbstractEventLoop, asyncio.Task[_LoopClient]] = {}
        #: probe the store (``ckptd.store.probe``) before the first conditional write:
        #: a store used directly by its writers (ranks, the CLI), which no ``ckptd
        #: serve`` checked at its start
        self.check_conditions = False
        #: a reader's store (``open_store(..., create=False)``): the first call finds
        #: nothing stored under the prefix, so ``NotFound`` naming it, not an empty store
        self.must_exist = False
        self._gaps: list[str] | None = None  # what the probe found, once it ran
        self._probing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary())

    # -- the client ---------------------------------------------------------------------

    def _config(self) -> AioConfig:
        config = AioConfig(
            # A host that takes no connection fails each attempt after seconds, not
            # after CKPTD_REQUEST_TIMEOUT (60 s, times the attempts).
            connect_timeout=knobs.connect_timeout(),
            read_timeout=knobs.request_timeout(),
            retries={"mode": "standard", "total_max_attempts": knobs.retries() + 1},
            # exists_many runs `concurrency` requests at once; let them all have a socket
            max_pool_connections=max(10, self.concurrency),
        )
        theirs = self._client_kwargs.get("config")
        return config.merge(theirs) if theirs is not None else config

    async def _open_client(self, loop: asyncio.AbstractEventLoop) -> _LoopClient:
        kwargs = {k: v for k, v in self._client_kwargs.items() if k != "config"}
        kwargs.setdefault("endpoint_url", self.endpoint_url)
        kwargs.setdefault("region_name", self.region)
        stack = AsyncExitStack()
        try:
            with self._lock:  # (a session reads the AWS config files: AWS_PROFILE...)
                if self._session is None:
                    self._session = _new_session()
                session = self._session
            client = await stack.enter_async_context(
                session.create_client("s3", config=self._config(), **kwargs)
            )
            # aiohttp starts its read timeout once a body is sent, and with "Expect:
            # 100-continue" sends it only after the 100: a PutObject to an endpoint
            # that never answers waited forever. (A write refused, 412 or 403, now
            # sends its body first: bodies are at most a chunk.)
            client.meta.events.unregister("before-call.s3", add_expect_header)
            client.meta.events.register_first("needs-retry.s3", never_retried)
            if self.must_exist:
                await self._holds_something(client)
        except BaseException as exc:
            await stack.aclose()
            with self._lock:  # so that the next call tries again
                if self._clients.get(loop) is asyncio.current_task():
                    del self._clients[loop]
            if isinstance(exc, CkptdError):  # (a CKPTD_* setting, a NotFound prefix)
                raise
            if (setting := aws_setting(exc)) is not None:
                raise setting from None
            if isinstance(exc, BotoCoreError | ClientError | ValueError):
                raise StoreError(f"cannot open an S3 client for {self.describe()}: {exc}") from exc
            raise
        opened = _LoopClient(client, stack)
        await anext(opened.closing)  # (the loop holds it from its first step)
        return opened

    async def check_open(self) -> None:
        client = await self._client()
        try:  # (a list names a missing bucket; a HEAD of a missing key would not)
            await client.list_objects_v2(Bucket=self.bucket, Prefix=self._root, MaxKeys=1)
        except (BotoCoreError, ClientError) as exc:
            raise self._failed("ListObjectsV2", "", exc) from exc

    async def _holds_something(self, client: Any) -> None:
        """``NotFound`` when no object lies under the prefix: S3 has no directories,
        so a mistyped prefix reads as an empty store (its jobs: none)."""
        try:
            page = await client.list_objects_v2(Bucket=self.bucket, Prefix=self._root,
                                                MaxKeys=2)
        except (BotoCoreError, ClientError) as exc:
            raise self._failed("ListObjectsV2", "", exc) from exc
        if not [o for o in page.get("Contents", ()) if o["Key"] != self._root]:
            raise NotFound(f"no store at {self._url()} (nothing is stored under it); check "
                           "the URL (only a save, an import or `ckptd serve` starts a store)",
                           store=self._url())

    async def _client(self) -> Any:
        loop = asyncio.get_running_loop()
        with self._lock:
            # Clients of loops that ended can not be closed any more; forget them.
            for dead in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[dead]
            task = self._clients.get(loop)
            if task is None:
                # A task, not a lock: concurrent first calls on this loop share one open.
                task = loop.create_task(self._open_client(loop))
                self._clients[loop] = task
        return (await asyncio.shield(task)).client

    async def close(self) -> None:
        """Closes the clients of this loop and of other loops still running."""
        here = asyncio.get_running_loop()
        with self._lock:
            tasks = list(self._clients.items())
            self._clients.clear()
        for loop, task in tasks:
            if loop is here:
                await asyncio.wait([task])  # (an open that failed told its own caller)
                if (opened := _opened(task)) is not None:
                    await opened.closing.aclose()
            elif loop.is_running() and (opened := _opened(task)) is not None:
                # Closed by that loop's own thread; waiting here could deadlock with it.
                asyncio.run_coroutine_threadsafe(opened.closing.aclose(), loop)

    # -- naming and errors ---------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    def _url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._root}{key}"

    def _failed(self, op: str, key: str, exc: Exception) -> StoreError:
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            message = exc.response.get("Error", {}).get("Message", "") or str(exc)
            hint = answer_hint(op, code, status, self.bucket, self.endpoint_url)
            return StoreError(
                f"S3 {op} of {self._url(key)} failed: {code or 'error'} "
                f"(HTTP {status}){hint}: {message}",
                key=key,
                s3_code=code,
                http_status=status,
            )
        return StoreError(f"S3 {op} of {self._url(key)} failed: {exc}"
                          f"{connection_hint(exc, self.endpoint_url)}",
                          key=key)

    async def _put(self, key: str, data: bytes | memoryview, *, read_back: bool = True,
                   **condition: str) -> bool:
        """A conditional PutObject; False when the condition failed.

        A retry (botocore's, after an attempt whose answer was lost) of a write that
        did succeed fails the condition against its own object: then (``read_back``)
        the object is read back, and holding exactly the bytes sent, the write is
        this call's (claims, leases and records carry a random token or are the same
        state). Not for content-addressed objects, whose bytes any writer sends."""
        name = self._key(key)
        body = data if isinstance(data, bytes) else bytes(data)
        client = await self._client()
        try:
            await client.put_object(Bucket=self.bucket, Key=name, Body=body, **condition)
        except ClientError as exc:
            if _code(exc) in _PRECONDITION_FAILED or _status(exc) == 412:
                if read_back and exc.response.get("ResponseMetadata", {}).get(
                        "RetryAttempts", 0):
                    return await self._landed(key, body)
                return False
            if _code(exc) in _CONFLICT or _status(exc) == 409:
                raise _Conflict from exc
            if "IfMatch" in condition and _code(exc) in _NOT_FOUND:
                return False  # deleted since we read its ETag
            raise self._failed("PutObject", key, exc) from exc
        except BotoCoreError as exc:
            raise self._failed("PutObject", key, exc) from exc
        return True

    async def _landed(self, key: str, body: bytes) -> bool:
        """Whether ``key`` holds exactly ``body``: an earlier attempt of a retried
        conditional write landed (so the write is this call's), or not (lost)."""
        try:
            landed = await self.get(key) == body
        except NotFound:
            return False
        if landed:
            log.info("a retried write of %s had landed on an earlier attempt", self._url(key))
        return landed

    # -- reads --------------------------------------------------------------------------

    async def _get_with_etag(self, key: str) -> tuple[bytes, str]:
        name = self._key(key)
        client = await self._client()
        try:
            resp = await client.get_object(Bucket=self.bucket, Key=name)
            async with resp["Body"] as stream:
                data: bytes = await stream.read()
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                raise NotFound(f"no object at {key}", key=key) from None
            raise self._failed("GetObject", key, exc) from exc
        except BotoCoreError as exc:
            raise self._failed("GetObject", key, exc) from exc
        return data, str(resp["ETag"])

    async def get(self, key: str) -> bytes:
        data, _ = await self._get_with_etag(key)
        return data

    async def exists(self, key: str) -> bool:
        name = self._key(key)
        client = await self._client()
        try:
            await client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise self._failed("HeadObject", key, exc) from exc
        except BotoCoreError as exc:
            raise self._failed("HeadObject", key, exc) from exc
        return True

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        # One HEAD per key (S3 has no batch HEAD), at most `concurrency` at a time.
        # `concurrency` workers over the keys: no task per key (a batch is 2,000).
        keys = [check_key(k) for k in keys]
        found = [False] * len(keys)
        todo = iter(enumerate(keys))

        async def worker() -> None:
            for i, key in todo:
                found[i] = await self.exists(key)

        await asyncio.gather(*(worker() for _ in range(max(1, min(self.concurrency, len(keys))))))
        return found

    async def _pages(self, prefix: str, op: str, **extra: str) -> AsyncIterator[dict[str, Any]]:
        client = await self._client()
        paginator = client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=self._root + prefix,
            PaginationConfig={"PageSize": self.page_size},
            **extra,
        )
        try:
            async for page in pages:
                yield page
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(op, prefix, exc) from exc

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # The prefix may end inside a name ("chunks/ab"): S3 prefixes are plain strings.
        check_prefix(prefix)
        cut = len(self._root)
        async for page in self._pages(prefix, "ListObjectsV2"):
            for obj in page.get("Contents", ()):
                yield obj["Key"][cut:]

    async def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        cut = len(self._root)
        async for page in self._pages(prefix, "ListObjectsV2"):
            for obj in page.get("Contents", ()):
                modified = obj.get("LastModified")
                yield ObjectInfo(obj["Key"][cut:], int(obj.get("Size", 0)),
                                 modified.timestamp() if modified is not None else None)

    async def list_dir(self, prefix: str) -> list[str]:
        if prefix:
            prefix = check_key(prefix.rstrip("/")) + "/"
        cut = len(self._root) + len(prefix)
        names: set[str] = set()
        async for page in self._pages(prefix, "ListObjectsV2", Delimiter="/"):
            for common in page.get("CommonPrefixes", ()):
                names.add(common["Prefix"][cut:].rstrip("/"))
            for obj in page.get("Contents", ()):
                names.add(obj["Key"][cut:])
        names.discard("")  # a "folder" marker object named like the prefix itself
        return sorted(names)

    # -- writes -------------------------------------------------------------------------

    async def _checked(self) -> None:
        """With ``check_conditions``: the probe, once (its own writes pass), and
        ``StoreError`` naming what the store lacks at every conditional write after."""
        if not self.check_conditions or _IN_PROBE.get():
            return
        if self._gaps is None:
            from ckptd.store.probe import conditional_write_gaps

            lock = self._probing.setdefault(asyncio.get_running_loop(), asyncio.Lock())
            async with lock:
                if self._gaps is None:
                    token = _IN_PROBE.set(True)
                    try:
                        self._gaps = await conditional_write_gaps(self)
                    finally:
                        _IN_PROBE.reset(token)
        if self._gaps:
            raise StoreError(
                f"store {self.describe()} cannot write conditionally: "
                f"{'; '.join(self._gaps)}. Its writers (ranks committing at once) could "
                "both win: use a store that honours If-None-Match and If-Match, or write "
                "through one `ckptd serve --single-writer` in front of it",
                store=self.describe(), lacks=list(self._gaps))

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        await self._checked()
        return await self._put_absent(key, data, read_back=True)

    async def put_content(self, key: str, data: bytes | memoryview,
                          verify: Callable[[], None] | None = None) -> bool:
        if verify is not None:
            await asyncio.to_thread(verify)
        # Equal bytes found on a retry say nothing of who wrote them (two replicas
        # store the same chunk at once): counted as not written here.
        return await self._put_absent(key, data, read_back=False)

    async def _put_absent(self, key: str, data: bytes | memoryview, *, read_back: bool) -> bool:
        # A 409 says another conditional write of the key was in flight, not that the
        # object exists: that write may still fail. False must mean "it is there", so
        # look, and write again if it is not.
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                return await self._put(key, data, read_back=read_back, IfNoneMatch="*")
            except _Conflict:
                if await self.exists(key):
                    return False
                await asyncio.sleep(knobs.retry_backoff() * 2**attempt)
        raise StoreError(
            f"S3 PutObject of {self._url(key)} kept conflicting with other writers "
            f"({_CONFLICT_ATTEMPTS} attempts)",
            key=key,
        )

    async def delete(self, key: str) -> None:
        name = self._key(key)
        client = await self._client()
        try:
            await client.delete_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return
            raise self._failed("DeleteObject", key, exc) from exc
        except BotoCoreError as exc:
            raise self._failed("DeleteObject", key, exc) from exc

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        if expected is None:
            return await self.put_if_absent(key, new)
        await self._checked()
        try:
            current, etag = await self._get_with_etag(key)
        except NotFound:
            return False
        if current != expected:
            return False
        # The ETag names the exact version we compared; If-Match makes the write lose
        # if anyone replaced it in between.
        try:
            return await self._put(key, new, IfMatch=etag)
        except _Conflict:
            return False  # a concurrent write of the ref: the caller re-reads and retries

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        await self._checked()
        try:
            current, etag = await self._get_with_etag(key)
        except NotFound:
            return False
        if current != expected:
            return False
        # If-Match on DeleteObject (S3 since 2024): the delete loses if anyone
        # replaced the object after we compared it.
        name = self._key(key)
        client = await self._client()
        try:
            await client.delete_object(Bucket=self.bucket, Key=name, IfMatch=etag)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND or _code(exc) in _PRECONDITION_FAILED or (
                _status(exc) in (409, 412)
            ):
                return False
            raise self._failed("DeleteObject", key, exc) from exc
        except BotoCoreError as exc:
            raise self._failed("DeleteObject", key, exc) from exc
        return True

    # -- presigned reads ----------------------------------------------------------------

    async def presign_reads(self, keys: Sequence[str], expires_in: int) -> list[str] | None:
        """A presigned GET URL for each of ``keys``, good for ``expires_in`` seconds
        (SigV4: whoever holds one may read that one object until then, and nothing
        else), or None when this store's client has no credentials to sign with.

        The URLs' scheme, host and path prefix are botocore's own for this client
        (its endpoint, addressing style and region); the signing is done here in
        bulk (``s3_presign``), off the event loop."""
        if not keys:
            return []
        client = await self._client()
        signer = getattr(client, "_request_signer", None)
        credentials = getattr(signer, "_credentials", None)
        if credentials is None:
            return None
        frozen = await credentials.get_frozen_credentials()
        if not frozen.access_key or not frozen.secret_key:
            return None
        base = await self._object_base(client)
        region = client.meta.region_name or "us-east-1"
        signing = SigningKey(frozen.access_key, frozen.secret_key, region, frozen.token)
        urls = [base + self._key(k) for k in keys]
        return await asyncio.to_thread(presign_get, signing, urls, expires_in)

    async def _object_base(self, client: Any) -> str:
        """The URL of this bucket's objects up to the key (``http://host/bucket/`` or
        ``https://bucket.host/``), as this client addresses them."""
        probe = "ckptd-presign-probe"
        try:
            template: str = await client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": probe}, ExpiresIn=60)
        except (BotoCoreError, ClientError, ValueError) as exc:
            raise self._failed("presign", probe, exc) from exc
        base = urlsplit(template)
        if not base.path.endswith("/" + probe):
            raise StoreError(f"cannot tell {self.describe()}'s object URLs from {template!r}")
        return f"{base.scheme}://{base.netloc}{base.path[: -len(probe)]}"

    def describe(self) -> str:
        """The store's URL, as ``open_store`` takes it (never credentials: they are
        refused in the URL)."""
        query = {k: v for k, v in (("endpoint", self.endpoint_url), ("region", self.region))
                 if v}
        url = f"s3://{self.bucket}/{self.prefix}"
        return url + (f"?{urlencode(query, safe=':/', quote_via=quote)}" if query else "")
