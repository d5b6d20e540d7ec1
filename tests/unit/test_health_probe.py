"""``/healthz``'s store probe does not wait behind the data plane's store calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from types import SimpleNamespace

from ckptd.server.routes import health
from ckptd.store.local import LocalStore

THREADS = 4  # the default pool's, set for the test: every one of them taken


def _take_the_threads(seconds: float) -> list[asyncio.Task[None]]:
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(THREADS))
    return [asyncio.create_task(asyncio.to_thread(time.sleep, seconds))
            for _ in range(THREADS)]


def test_an_answer_does_not_wait_for_the_store_threads(tmp_path: Path) -> None:
    """A local store's calls run on the default thread pool, which the data plane's
    store calls fill under load (16 manifests' writes and fsyncs): a probe that was
    due waited behind them, and /healthz with it (50 - 150 ms more in
    bench.commit_scale, here 1.5 s). The answer is now the last probe's, and the
    next probe runs beside it."""
    repo = SimpleNamespace(store=LocalStore(tmp_path / "store"))  # (.store is all it reads)

    async def go() -> tuple[bool, float, bool]:
        assert await health._store_ok(repo)  # the first probe: waited for
        await asyncio.sleep(health.PROBE_EVERY_S)  # the next one is due
        busy = _take_the_threads(1.5)
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        ok = await health._store_ok(repo)
        waited = time.monotonic() - t0
        await asyncio.gather(*busy)
        await asyncio.sleep(0.1)  # the probe ran once the threads were free
        return ok, waited, await health._store_ok(repo)

    ok, waited, later = asyncio.run(go())
    assert ok and later
    assert waited < 0.2, waited


def test_a_store_that_hangs_is_not_ok_within_the_probe_timeout(tmp_path: Path,
                                                                monkeypatch) -> None:  # noqa: ANN001
    """With no probe ended for PROBE_EVERY_S + PROBE_TIMEOUT_S the answer waits for
    the one under way, which gives up after PROBE_TIMEOUT_S: "not ok"."""
    monkeypatch.setattr(health, "PROBE_EVERY_S", 0.05)
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.2)
    repo = SimpleNamespace(store=LocalStore(tmp_path / "store"))

    async def go() -> tuple[bool, bool, float]:
        first = await health._store_ok(repo)
        busy = _take_the_threads(2.0)
        await asyncio.sleep(0.3)  # past PROBE_EVERY_S + PROBE_TIMEOUT_S
        t0 = time.monotonic()
        answers = [await health._store_ok(repo)]
        while answers[-1] and time.monotonic() - t0 < 1.5:
            await asyncio.sleep(0.05)
            answers.append(await health._store_ok(repo))
        took = time.monotonic() - t0
        await asyncio.gather(*busy)
        return first, answers[-1], took

    first, last, took = asyncio.run(go())
    assert first and not last
    assert took < 1.0, took
