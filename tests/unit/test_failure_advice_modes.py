"""A failed save's advice says what the ``on_error`` in force does next: under
"raise" (the default) the loop's next call raises it, under "warn" training goes
on. (It said "training goes on" under both: a probe's job ended at the next
``step()`` right after being told it would go on.)"""

from __future__ import annotations

import pytest

from ckptd.client.failures import FailureLog, advice, name_save_error
from ckptd.errors import CkptdError, Forbidden, StoreFull, Timeout, Unavailable

CASES = [
    Unavailable("cannot reach the ckptd server"),
    Timeout("the upload took too long"),
    StoreFull("the store has 10 bytes left"),
    Forbidden("this token (read on 'llm-*') may not write job 'llm-b'", job="llm-b"),
    CkptdError("something else"),
]


@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_advice_under_raise_says_the_next_call_raises(exc: CkptdError) -> None:
    said = advice(name_save_error(exc, "llm-b", 3, 0), "raise")
    assert "training goes on" not in said, said
    assert "the next save(), step() or close() raises" in said, said


@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_advice_under_warn_says_training_goes_on(exc: CkptdError) -> None:
    said = advice(name_save_error(exc, "llm-b", 3, 0), "warn")
    assert "training goes on" in said and "raises" not in said, said


def test_store_full_and_forbidden_say_what_to_do() -> None:
    full = advice(name_save_error(StoreFull("no space"), "j", 1, 0), "raise")
    assert "ckptd forget" in full and "ckptd gc" in full, full
    refused = advice(name_save_error(Forbidden("may not write", job="llm-b"), "llm-b", 1, 0))
    assert "--job llm-b --role write" in refused, refused


def test_the_log_line_follows_the_mode(caplog: pytest.LogCaptureFixture) -> None:
    for mode, words in (("raise", "raises this error"), ("warn", "training goes on")):
        caplog.clear()
        FailureLog("j", 0, mode).record(1, Unavailable("down"), snapshot=1)
        assert any(words in r.getMessage() for r in caplog.records), caplog.records
