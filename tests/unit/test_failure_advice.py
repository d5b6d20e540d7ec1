"""What a failed snapshot's log line tells a person to do: the advice fits the error."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from ckptd.client.failures import advice, name_save_error
from ckptd.client.loop import ClientClosing, in_thread
from ckptd.errors import AlreadyCommitted


def test_a_committed_step_is_not_told_it_is_not_committed() -> None:
    err = name_save_error(AlreadyCommitted("step 3 of j1 is committed"), "j1", 3, 0)
    said = advice(err)
    assert "not committed" not in said and "committed already" in said, said


async def test_an_upload_cut_by_the_executors_shutdown_says_it_was_interrupted() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    asyncio.get_running_loop().set_default_executor(pool)
    pool.shutdown()  # what an exiting interpreter (Ctrl-C in wait()) does to it
    with pytest.raises(ClientClosing) as caught:
        await in_thread(sum, [1, 2])
    said = advice(name_save_error(caught.value, "j1", 3, 0))
    assert "interrupted" in said and "training goes on" not in said, said
