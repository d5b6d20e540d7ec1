"""A client and a newer server (docs/API.md, "Answers may grow"): a field a newer
server adds to an answer is ignored, so saves, restores and the command line work
through a rolling upgrade that goes servers first; an answer that lacks a field
the client needs is still the typed "one ckptd version?" error, in one line.

The newer server is this one behind a relay that adds a field to every JSON
answer (and to each object of its lists, the shape of ``members``, ``jobs`` or
``steps``), as a release that grows the API would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from tests.conftest import ServerProcess
from tests.relay import relay

pytestmark = pytest.mark.timeout(180)

ADDED = "added_by_a_newer_server"


def _grown(doc: Any) -> Any:
    # The format's documents (a commit record, a manifest: they carry "format") are
    # not answers the API may grow: their bytes are hashed, and readers refuse what
    # they do not know.
    if isinstance(doc, dict) and "format" not in doc:
        for value in doc.values():
            for item in value if isinstance(value, list) else []:
                if isinstance(item, dict) and "format" not in item:
                    item[ADDED] = {"meaning": 42}
        doc[ADDED] = [1, "two"]
    return doc


def _without_latest(doc: Any) -> Any:
    if isinstance(doc, dict):
        for item in doc.get("jobs", []):
            item.pop("latest", None)
    return doc


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, timeout=120)


def test_answers_with_fields_this_client_does_not_know_are_read(
        shared_server: ServerProcess, shm: Path) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}
    with relay(shared_server.url, change=_grown) as url:
        # the relay really grows the answers the client reads
        assert ADDED in httpx.get(f"{url}/v1/cluster", timeout=10).json()
        with Checkpointer(url, "newer-server", shm_dir=shm) as ckpt:
            for step in (1, 2):
                state["w"] += 1
                assert ckpt.save(step, state).wait(60).state == "committed"
            assert ckpt.latest() == 2
            into = {"w": torch.zeros(4096), "b": torch.zeros(7)}
            result = ckpt.restore(into, tiers=["store"])
        assert result.step == 2 and torch.equal(into["w"], state["w"])
        listed = _ckptd("ls", "--url", url)
        steps = _ckptd("ls", "newer-server", "--url", url)
    assert listed.returncode == 0, listed.stderr
    assert "newer-server" in listed.stdout and "Traceback" not in listed.stderr
    assert steps.returncode == 0 and "committed" in steps.stdout, steps.stdout + steps.stderr


def test_an_answer_without_a_field_the_client_needs_is_one_line(
        shared_server: ServerProcess, shm: Path) -> None:
    with Checkpointer(shared_server.url, "older-answer", shm_dir=shm) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)}).wait(60)
    with relay(shared_server.url, change=_without_latest) as url:
        done = _ckptd("ls", "--url", url)
    assert done.returncode != 0
    assert "one ckptd version" in done.stderr and "latest" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr


def test_a_document_inside_an_answer_is_still_read_strictly(
        shared_server: ServerProcess, shm: Path) -> None:
    """(Found by review.) The answers' override reaches the models nested in them: the
    commit record in a commit's answer is read by its own parser, which refuses a
    field the format does not have."""
    from ckptd.errors import InvalidDocument

    def grown_record(doc: Any) -> Any:
        if isinstance(doc, dict) and isinstance(doc.get("record"), dict):
            doc["record"][ADDED] = 1
        return doc

    with relay(shared_server.url, change=grown_record) as url, Checkpointer(
            url, "grown-record", shm_dir=shm, serve_peers=False) as ckpt, pytest.raises(
            InvalidDocument, match=f"commit record: {ADDED}"):
        ckpt.save(1, {"w": torch.ones(4)}).wait(60)
