"""A store wrapper that fails chosen calls, for tests that inject trouble.

The test drives it and counts it, instead of sleeping and hoping::

    store = FaultyStore(MemoryStore())
    store.fail_at("put_if_absent", match="/commit.json")   # the next commit record write
    with pytest.raises(StoreError):
        await Repository(store).commit("job", 2)
    assert store.failures["put_if_absent"] == 1

A fault fires once, on the ``nth`` call of ``op`` (counted from when it was armed)
whose key matches. With ``after=True`` the call reaches the inner store first and
the error is raised on the way back: the write happened, but the caller never
learned it did (a crash between the write and its acknowledgement).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from ckptd.errors import InvalidRequest, StoreError
from ckptd.store.base import Store

OPS = (
    "get",
    "put_if_absent",
    "exists",
    "exists_many",
    "delete",
    "list_prefix",
    "list_dir",
    "compare_and_swap",
    "compare_and_delete",
)
#: the operations that change the store
WRITE_OPS = ("put_if_absent", "delete", "compare_and_swap", "compare_and_delete")

KeyMatch = str | Callable[[str], bool] | None


@dataclass(slots=True)
class Fault:
    """One armed fault: fires on the ``nth`` matching call of ``op``."""

    op: str
    nth: int
    exc: BaseException | type[BaseException] | None
    match: KeyMatch
    after: bool
    seen: int = 0
    fired: bool = False

    def matches(self, key: str) -> bool:
        if self.match is None:
            return True
        if isinstance(self.match, str):
            return self.match in key
        return self.match(key)

    def error(self, key: str) -> BaseException:
        if self.exc is None:
            return StoreError(f"injected fault: {self.op} {key}", key=key, injected=True)
        if isinstance(self.exc, type):
            return self.exc(f"injected fault: {self.op} {key}")
        return self.exc


class FaultyStore(Store):
    """Wraps a store; counts every call and fails the ones a test arms."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.durable = inner.durable
        self.cross_process_cas = inner.cross_process_cas
        #: calls per operation, failed ones included
        self.calls: Counter[str] = Counter()
        #: injected failures per operation
        self.failures: Counter[str] = Counter()
        #: (op, key) of every call, in order; exists_many logs one row per key
        self.log: list[tuple[str, str]] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    # -- arming and counting ----------------------------------------------------------

    def fail_at(
        self,
        op: str,
        nth: int = 1,
        exc: BaseException | type[BaseException] | None = None,
        *,
        match: KeyMatch = None,
        after: bool = False,
    ) -> Fault:
        """Arms a fault on the ``nth`` (1-based) next call of ``op`` whose key
        contains ``match`` (a string) or satisfies it (a callable).

        ``exc`` defaults to a ``StoreError``; ``after=True`` lets the call reach
        the inner store before raising."""
        if op not in OPS:
            raise InvalidRequest(f"unknown store operation {op!r}; one of {OPS}")
        if nth < 1:
            raise InvalidRequest("nth counts from 1")
        fault = Fault(op=op, nth=nth, exc=exc, match=match, after=after)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Disarms every fault that has not fired yet."""
        with self._lock:
            self._faults.clear()

    @property
    def armed(self) -> int:
        """Faults that have not fired yet."""
        with self._lock:
            return sum(not f.fired for f in self._faults)

    def count(self, op: str, match: KeyMatch = None) -> int:
        """Calls of ``op`` so far whose key matches (every call without ``match``)."""
        probe = Fault(op=op, nth=1, exc=None, match=match, after=False)
        with self._lock:
            return sum(1 for o, k in self.log if o == op and probe.matches(k))

    def writes(self) -> int:
        """Calls so far that could change the store."""
        with self._lock:
            return sum(self.calls[op] for op in WRITE_OPS)

    def _enter(self, op: str, keys: Iterable[str]) -> Fault | None:
        """Counts a call and returns the fault it triggers, if any."""
        keys = list(keys)
        with self._lock:
            self.calls[op] += 1
            self.log.extend((op, k) for k in keys)
            for fault in self._faults:
                if fault.fired or fault.op != op:
                    continue
                if fault.match is not None and not any(fault.matches(k) for k in keys):
                    continue
                fault.seen += 1
                if fault.seen == fault.nth:
                    fault.fired = True
                    self.failures[op] += 1
                    return fault
        return None

    # -- the Store interface ------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        fault = self._enter("get", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        data = await self.inner.get(key)
        if fault is not None:
            raise fault.error(key)
        return data

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        fault = self._enter("put_if_absent", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        created = await self.inner.put_if_absent(key, data)
        if fault is not None:
            raise fault.error(key)
        return created

    async def exists(self, key: str) -> bool:
        fault = self._enter("exists", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        found = await self.inner.exists(key)
        if fault is not None:
            raise fault.error(key)
        return found

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        fault = self._enter("exists_many", keys)
        where = keys[0] if keys else ""
        if fault is not None and not fault.after:
            raise fault.error(where)
        found = await self.inner.exists_many(keys)
        if fault is not None:
            raise fault.error(where)
        return found

    async def delete(self, key: str) -> None:
        fault = self._enter("delete", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        await self.inner.delete(key)
        if fault is not None:
            raise fault.error(key)

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        fault = self._enter("list_prefix", [prefix])
        if fault is not None and not fault.after:
            raise fault.error(prefix)
        keys = [key async for key in self.inner.list_prefix(prefix)]
        if fault is not None:
            raise fault.error(prefix)
        for key in keys:
            yield key

    async def list_dir(self, prefix: str) -> list[str]:
        fault = self._enter("list_dir", [prefix])
        if fault is not None and not fault.after:
            raise fault.error(prefix)
        names = await self.inner.list_dir(prefix)
        if fault is not None:
            raise fault.error(prefix)
        return names

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        fault = self._enter("compare_and_swap", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        swapped = await self.inner.compare_and_swap(key, expected, new)
        if fault is not None:
            raise fault.error(key)
        return swapped

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        fault = self._enter("compare_and_delete", [key])
        if fault is not None and not fault.after:
            raise fault.error(key)
        deleted = await self.inner.compare_and_delete(key, expected)
        if fault is not None:
            raise fault.error(key)
        return deleted

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> str:
        return f"faulty+{self.inner.describe()}"
