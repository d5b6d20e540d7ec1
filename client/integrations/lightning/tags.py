"""A job's tags and latest step, synchronously, through a ckptd server (http://)
or straight on a directory store (file://): what the Lightning plugin names
checkpoint paths with."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ckptd.cluster import STORE_ID_KEY, StoreIdentity
from ckptd.errors import CkptdError, NotFound
from ckptd.lifecycle.tags import check_tag, read_tags, remove_tag

from ...calls import cluster, tag, tags, untag
from ...loop import run_private
from ...transport import LocalTransport, open_transport
from ...transport_http import SyncTransport

log = logging.getLogger(__name__)


class JobTags:
    """Tag name -> step of one job, set, read and removed (thread-safe per call)."""

    def __init__(self, url: str, token: str | None, job: str) -> None:
        self.job = job
        self._server: SyncTransport | None = None
        self._url = url
        if url.startswith(("http://", "https://")):
            self._server = SyncTransport(url, token, job=job)

    def _local(self, work: Any) -> Any:
        """``work(transport)`` on a directory store, on a private loop."""

        async def go() -> Any:
            transport = open_transport(self._url)
            assert isinstance(transport, LocalTransport)
            try:
                return await work(transport)
            finally:
                await transport.close()

        return run_private(go(), 60.0, what=f"reading the tags of {self.job}")

    def all(self) -> dict[str, int]:
        if self._server is not None:
            return self._server.run(tags(self.job))
        return dict(self._local(lambda t: read_tags(t.repository.store, self.job)))

    def get(self, name: str) -> int | None:
        return self.all().get(check_tag(name))

    def set(self, name: str, step: int) -> None:
        """Points ``name`` at committed ``step``."""
        if self._server is not None:
            self._server.run(tag(self.job, name, step))
            return
        self._local(lambda t: t.repository.tag(self.job, check_tag(name), step))

    def remove(self, name: str, step: int | None) -> None:
        """Removes ``name`` if it names ``step`` (any step when None); gone already
        is fine."""
        if step is not None and self.get(name) != step:
            return
        if self._server is not None:
            with contextlib.suppress(NotFound):
                self._server.run(untag(self.job, name))
            return
        self._local(lambda t: remove_tag(t.repository.store, self.job, check_tag(name)))

    def latest(self) -> int | None:
        """The job's newest committed step, or None."""
        if self._server is not None:
            return self._server.latest(self.job)
        result = self._local(lambda t: t.latest(self.job))
        return None if result is None else int(result)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def store_id(self) -> str | None:
        """The id of the store (``cluster/store-id``), or None where it has none or
        it cannot be read now."""
        try:
            if self._server is not None:
                return self._server.run(cluster()).store_id
            return self._local(_local_store_id)  # type: ignore[no-any-return]
        except CkptdError as exc:
            log.debug("%s: the store's id is not known: %s", self.job, exc)
            return None


async def _local_store_id(transport: LocalTransport) -> str | None:
    try:
        return StoreIdentity.parse(await transport.repository.store.get(STORE_ID_KEY)).id
    except NotFound:
        return None
