"""A zarr export interrupted with reads in flight (a full run's Ctrl-C test): zarr's
exit hook shuts its loop's executor down, and a read that then asks it for a thread
was a RuntimeError no one retrieved, printed as a traceback after the command's one
line. It is a cancel: the process is ending, the read abandoned."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

pytest.importorskip("zarr")

from ckptd.client.zarr_view import _in_thread  # noqa: E402


async def test_a_read_after_the_executor_shut_down_is_cancelled_not_failed() -> None:
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(1)
    loop.set_default_executor(executor)
    assert await _in_thread(sum, [1, 2]) == 3
    executor.shutdown(wait=True)
    task = asyncio.ensure_future(_in_thread(sum, [1, 2]))
    await asyncio.wait([task])
    assert task.cancelled()  # (a cancelled task logs nothing when no one awaits it)


async def test_other_errors_of_the_call_are_its_own() -> None:
    def broken() -> None:
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        await _in_thread(broken)
