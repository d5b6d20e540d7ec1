"""``CkptdTransport`` against torchft's ``CheckpointTransport`` interface: two
transports on 127.0.0.1, one sends (stages, hashes, serves), the other receives
every chunk verified; a flipped byte in the sender's pool fails the receive with
``ChunkHashMismatch``, and what cannot be healed says so with a typed error."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import (
    ChunkHashMismatch,
    Conflict,
    InvalidRequest,
    RestoreError,
    Timeout,
    Unauthorized,
    UnsupportedValue,
)

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("torchft", reason="pip install 'ckptd[torchft]'")

from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402

from ckptd.client.integrations.torchft import CkptdTransport  # noqa: E402
from ckptd.client.staging.inventory import list_pools  # noqa: E402

T10 = timedelta(seconds=10)
LIGHTHOUSE = "http://127.0.0.1:29510"


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lighthouse on this host: the transports advertise 127.0.0.1, the address on
    the route to it (tests talk over loopback only)."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LIGHTHOUSE)
    for name in ("CKPTD_PEER_HOST", "CKPTD_PEER_INTERFACE", "CKPTD_PEER_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pair(shm: Path) -> Iterator[tuple[CkptdTransport[Any], CkptdTransport[Any]]]:
    sender: CkptdTransport[Any] = CkptdTransport(chunk_size=64 * 1024, shm_dir=str(shm))
    receiver: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    try:
        yield sender, receiver
    finally:
        sender.shutdown()
        receiver.shutdown()


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Linear(300, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 200)).sum().backward()
    opt.step()
    return {
        "user": {"default": {"model": model.state_dict(), "optim": opt.state_dict(),
                             "bf16": torch.arange(7, dtype=torch.bfloat16),
                             "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)}},
        "torchft": {"step": 3, "batches_committed": 6},
    }


def _bitwise(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _bitwise(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _bitwise(x, y)
    else:
        assert a == b and type(a) is type(b)


def _data_chunk(t: CkptdTransport[Any]) -> str:
    """A chunk id the sender serves that is not the manifest's."""
    manifest = t._server.manifest
    assert manifest is not None
    return next(cid for cid in t._server.index.chunks if cid != manifest[0])


def test_it_is_a_torchft_transport(pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, _ = pair
    assert isinstance(sender, CheckpointTransport)
    doc = json.loads(sender.metadata())
    assert doc["url"].startswith("http://127.0.0.1:") and doc["token"]


def test_receive_is_bitwise_the_state_sent(pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    state = _state()
    sender.send_checkpoint([1], 3, state, T10)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
    _bitwise(state, got)
    # Received into fresh tensors: the sender's state is not shared.
    weight = got["user"]["default"]["model"]["0.weight"]
    assert weight.data_ptr() != state["user"]["default"]["model"]["0.weight"].data_ptr()
    assert receiver.stats.receives == 1
    # Every chunk of the state was hashed on arrival (the 64 KiB chunks of 240 KB
    # of weights, and the manifest).
    assert receiver.stats.chunks_verified > 10
    assert receiver.stats.bytes_received == sender.stats.bytes_staged


def test_the_sender_serves_its_copy_after_the_state_changes(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    """send_checkpoint stages a copy: torchft may step the optimizer as soon as
    disallow_checkpoint returns, and a late receiver still gets the step it asked for."""
    sender, receiver = pair
    state = _state()
    expected = {k: v.clone() for k, v in state["user"]["default"]["model"].items()}
    sender.send_checkpoint([1], 3, state, T10)
    sender.disallow_checkpoint()
    for t in state["user"]["default"]["model"].values():
        t.add_(1.0)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
    _bitwise(expected, got["user"]["default"]["model"])


def test_a_flipped_byte_fails_the_heal_with_a_typed_error(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(), T10)
    cid = _data_chunk(sender)
    sender._server.index.chunks[cid][100] ^= 0x01  # one bit of the pool, after hashing
    with pytest.raises(ChunkHashMismatch) as err:
        receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
    assert err.value.detail["id"] == cid and err.value.detail["step"] == 3
    assert "refused" in err.value.message
    assert receiver.stats.receives == 0  # nothing was handed to torchft


def test_a_damaged_manifest_fails_the_heal(pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(), T10)
    assert sender._server.manifest is not None
    mid = sender._server.manifest[0]
    # The manifest's bytes are immutable: serve a damaged copy under its id.
    index = sender._server.index
    damaged = bytearray(index.chunks[mid])
    damaged[10] ^= 0x20
    chunks = dict(index.chunks)
    chunks[mid] = memoryview(bytes(damaged))
    sender._server.publish(type(index)(step=index.step, chunks=chunks, valid=index.valid))
    with pytest.raises(ChunkHashMismatch, match="the manifest"):
        receiver.recv_checkpoint(0, sender.metadata(), 3, T10)


def test_a_receive_waits_for_the_step_to_be_staged(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    """torchft runs the recovering group's recv beside the healthy group's send: a
    receive that asks first waits for the step."""
    sender, receiver = pair
    state = _state()
    timer = threading.Timer(0.3, sender.send_checkpoint, ([1], 5, state, T10))
    timer.start()
    try:
        t0 = time.monotonic()
        got = receiver.recv_checkpoint(0, sender.metadata(), 5, T10)
        assert time.monotonic() - t0 >= 0.25
    finally:
        timer.join()
    _bitwise(state, got)


def test_another_step_or_no_step_is_a_typed_error(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    with pytest.raises(Timeout, match="did not serve step 3"):
        receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=0.3))
    sender.send_checkpoint([1], 4, _state(), T10)
    with pytest.raises(Conflict, match="serves step 4, past step 3"):
        receiver.recv_checkpoint(0, sender.metadata(), 3, T10)


def test_ckptd_shm_shows_the_step_a_sender_serves_as_whole(
        pair: tuple[CkptdTransport[Any], ...], shm: Path) -> None:
    """``ckptd shm`` showed a sender's pool as '1 (staging, not whole)' after the send
    had completed."""
    sender, _ = pair
    sender.send_checkpoint([1], 3, _state(), T10)
    pools = [p for p in list_pools(shm)[0] if p.directory == sender._pool.directory]
    assert [(p.step, p.state, p.restorable, p.alive) for p in pools] == [
        (3, "staged", True, True)]

def test_a_wrong_token_or_foreign_metadata_is_refused(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(), T10)
    doc = json.loads(sender.metadata())
    doc["token"] = "not-the-token"
    with pytest.raises(Unauthorized):
        receiver.recv_checkpoint(0, json.dumps(doc), 3, T10)
    with pytest.raises(InvalidRequest, match="every replica group must use CkptdTransport"):
        receiver.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 3, T10)


def test_unstorable_leaves_are_refused_before_anything_is_served(
        pair: tuple[CkptdTransport[Any], ...]) -> None:
    sender, receiver = pair
    with pytest.raises(UnsupportedValue, match="object"):
        sender.send_checkpoint([1], 3, {"user": {"fn": object()}}, T10)
    assert sender._server.held_step is None


def test_a_template_is_filled_in_place(shm: Path) -> None:
    """With ``state_dict=`` (the way to receive DTensors), the receive fills the
    template's own tensors and returns it."""
    template = _state(seed=1)
    weight = template["user"]["default"]["model"]["0.weight"]
    sender: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    receiver: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm), state_dict=lambda: template)
    try:
        state = _state(seed=0)
        sender.send_checkpoint([1], 3, state, T10)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
    finally:
        sender.shutdown()
        receiver.shutdown()
    assert got is template
    assert got["user"]["default"]["model"]["0.weight"] is weight
    _bitwise(state, got)


def test_shutdown_removes_the_pool_and_stops_serving(shm: Path) -> None:
    t: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    t.send_checkpoint([1], 1, _state(), T10)
    assert any(shm.iterdir())
    t.shutdown()
    t.shutdown()  # idempotent
    assert not any(p for p in shm.rglob("*") if p.is_file())
    other: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    try:
        with pytest.raises(Exception) as err:
            other.recv_checkpoint(0, t.metadata(), 1, timedelta(seconds=1))
        assert type(err.value).__name__ in ("Unavailable", "Timeout")
    finally:
        other.shutdown()


def test_a_send_after_shutdown_says_the_transport_was_shut_down(
        pair: tuple[CkptdTransport[Any], ...], shm: Path) -> None:
    """(Found by a probe.) It said only "this staging pool is closed": a pool the
    caller never made, of a transport they had shut down."""
    sender, receiver = pair
    sender.send_checkpoint([1], 1, _state(), T10)
    sender.shutdown()
    with pytest.raises(InvalidRequest) as info:
        sender.send_checkpoint([1], 2, _state(), T10)
    said = str(info.value)
    assert "CkptdTransport was shut down" in said and "make a new one" in said, said
    assert "\n" not in said
    # A new transport sends, and is received from, as before (by the one shut
    # down too: a receive needs no server or pool of its own).
    again: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    try:
        again.send_checkpoint([1], 2, _state(), T10)
        _bitwise(_state(), receiver.recv_checkpoint(0, again.metadata(), 2, T10))
        _bitwise(_state(), sender.recv_checkpoint(0, again.metadata(), 2, T10))
    finally:
        again.shutdown()


def test_a_transport_is_reachable_from_other_hosts_by_default(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica groups heal across hosts: the sender listens on every interface (its
    token guards it) and advertises its address on the route to the lighthouse, as
    a Checkpointer's peer server does. It bound 127.0.0.1 and advertised it, so a
    group on another host could never heal from it unless told host="0.0.0.0"."""
    from urllib.parse import urlparse

    from ckptd.client.peer.address import WILDCARDS, route_address

    sender: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    receiver: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    try:
        assert sender._server.host in WILDCARDS
        url = json.loads(sender.metadata())["url"]
        assert urlparse(url).hostname == route_address(LIGHTHOUSE) == "127.0.0.1"
        sender.send_checkpoint([1], 3, {"w": torch.arange(10.0)}, T10)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
        assert torch.equal(got["w"], torch.arange(10.0))
        # Without a lighthouse named, the address on the default route (no connection
        # is made to see it: a UDP socket's connect sends nothing).
        monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
        other: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
        try:
            assert urlparse(json.loads(other.metadata())["url"]).hostname == route_address()
        finally:
            other.shutdown()
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_sender_that_stages_the_next_step_mid_heal_fails_it_with_conflict(
        pair: tuple[CkptdTransport[Any], ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's next send_checkpoint restages its pool while a receiver is still
    fetching the step before: the receive fails with ``Conflict`` naming both steps,
    as the docs say (it was ``ChunkNotFound``, as if the sender had lost a chunk),
    and nothing is returned."""
    import ckptd.client.integrations.torchft.transport as torchft_module

    sender, receiver = pair
    state = {"w": torch.arange(64 * 1024 * 4, dtype=torch.float32)}  # 16 chunks
    sender.send_checkpoint([1], 1, state, T10)
    fetch = torchft_module._fetch_verified
    fetched: list[str] = []

    def then_restage(client: Any, url: str, cid: str, dest: Any, step: int, what: str) -> None:
        fetch(client, url, cid, dest, step, what)
        fetched.append(what)
        if len(fetched) == 2:  # the manifest and one chunk in: the next step comes
            sender.send_checkpoint([1], 2, {"w": state["w"] + 1}, T10)

    monkeypatch.setattr(torchft_module, "_fetch_verified", then_restage)
    receiver.concurrency = 1
    with pytest.raises(Conflict, match="step 2 .*step 1|step 1.*step 2"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, T10)
    assert len(fetched) >= 2


def test_a_template_holding_entries_the_sender_lacks_is_refused_unchanged(shm: Path) -> None:
    """As ``Checkpointer.restore`` refuses a target holding entries the step lacks,
    the heal refuses a template holding entries the sender did not send, naming them,
    before the template changes (they kept the receiver's own values: a stale state
    that looked healed). Entries sent beyond the template are added, as restore adds
    them to a plain dict."""
    template = {"w": torch.zeros(4, 4), "extra": torch.zeros(1),
                "meta": {"lr": 0.1, "mom": 0.9}}
    sender: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm))
    receiver: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm), state_dict=lambda: template)
    try:
        sender.send_checkpoint([1], 3, {"w": torch.ones(4, 4), "meta": {"lr": 0.5}}, T10)
        with pytest.raises(RestoreError) as err:
            receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
        assert err.value.detail["entries"] == ["state['extra']", "state['meta']['mom']"]
        assert "state['extra'], state['meta']['mom']" in err.value.message
        assert "step 3" in err.value.message and "\n" not in err.value.message
        assert torch.equal(template["w"], torch.zeros(4, 4))
        assert template["meta"] == {"lr": 0.1, "mom": 0.9}
        assert receiver.stats.receives == 0
        sent = {"w": torch.ones(4, 4), "extra": torch.ones(1), "meta": {"lr": 0.5, "mom": 0.8},
                "new": torch.arange(2.0)}
        sender.send_checkpoint([1], 4, sent, T10)
        got = receiver.recv_checkpoint(0, sender.metadata(), 4, T10)
    finally:
        sender.shutdown()
        receiver.shutdown()
    assert got is template
    _bitwise(sent, got)


def test_timeouts_take_seconds_and_bad_arguments_are_refused_at_the_call(
        pair: tuple[CkptdTransport[Any], ...], shm: Path) -> None:
    """torchft passes timedeltas; plain seconds are taken too (they failed in the
    receive with an AttributeError). A bad timeout or port is refused in one line
    where it is given (a port past 65535 was an OverflowError from bind())."""
    sender, receiver = pair
    sender.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, 10)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, 2.5)
    assert torch.equal(got["w"], torch.arange(4.0))
    for bad in (True, 0, -1, float("nan"), "5"):
        with pytest.raises(InvalidRequest, match="timeout") as err:
            receiver.recv_checkpoint(0, sender.metadata(), 3, bad)  # type: ignore[arg-type]
        assert "\n" not in err.value.message
    with pytest.raises(InvalidRequest, match="timeout"):
        sender.send_checkpoint([1], 4, {"w": torch.arange(4.0)}, None)  # type: ignore[arg-type]
    t: CkptdTransport[Any] = CkptdTransport(5, shm_dir=str(shm / "own"))
    try:
        assert t.timeout == timedelta(seconds=5)
    finally:
        t.shutdown()
    with pytest.raises(InvalidRequest, match="timeout"):
        CkptdTransport("60", shm_dir=str(shm / "own"))  # type: ignore[arg-type]
    for port in (70000, -1, True):
        with pytest.raises(InvalidRequest, match="port .*65535"):
            CkptdTransport(port=port, shm_dir=str(shm / "own"))
    assert not any(p for p in (shm / "own").rglob("*") if p.is_file())


@pytest.mark.parametrize(("argument", "bad"), [
    ("chunk_size", 0), ("chunk_size", 7), ("chunk_size", -5), ("chunk_size", 1.5),
    ("chunk_size", 8192.0), ("chunk_size", "65536"), ("chunk_size", True),
    ("chunk_size", (256 << 20) + 1), ("concurrency", 0), ("concurrency", -1),
    ("concurrency", 2.5), ("concurrency", 65), ("concurrency", None),
])
def test_a_bad_chunk_size_or_concurrency_is_refused_where_it_is_given(
        shm: Path, argument: str, bad: object) -> None:
    """chunk_size=0 was a ZeroDivisionError in the first send, 7 an InvalidDocument
    there, 1.5 became 1, -5 a plain ValueError; concurrency 0 or -1 became 1."""
    with pytest.raises(InvalidRequest, match=f"^{argument} must be a whole number from "
                       r"\d+ to \d+, not ") as err:
        CkptdTransport(shm_dir=str(shm), **{argument: bad})  # type: ignore[arg-type]
    assert "\n" not in err.value.message
    assert not any(p for p in shm.rglob("*") if p.is_file())


@pytest.mark.parametrize(("sender_token", "receiver_token", "this_group"), [
    ("token-of-group-a", "token-of-group-b", "another"),
    ("token-of-group-a", None, "none"),
])
def test_groups_given_different_tokens_are_told_to_give_all_the_same(
        shm: Path, sender_token: str, receiver_token: str | None, this_group: str) -> None:
    """Replica groups with different token= never healed, each heal failing with
    'missing or wrong peer token' (torchft retried it every quorum)."""
    sender: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm), token=sender_token)
    receiver: CkptdTransport[Any] = CkptdTransport(shm_dir=str(shm), token=receiver_token)
    try:
        sender.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, T10)
        with pytest.raises(Unauthorized) as err:
            receiver.recv_checkpoint(0, sender.metadata(), 3, T10)
    finally:
        sender.shutdown()
        receiver.shutdown()
    message = err.value.message
    assert "every replica group must be given the same CkptdTransport(token=...)" in message
    assert message.endswith(f"this group {this_group}") and "\n" not in message
    assert "token-of-group" not in message


def test_a_lighthouse_that_gives_no_route_is_said(
        shm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """TORCHFT_LIGHTHOUSE='http://[bad:1' raised urllib's bare 'Invalid IPv6 URL',
    naming neither the variable nor ckptd; a host that does not resolve, or one
    without its scheme, advertised 127.0.0.1 in silence, which no other host reaches."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://[bad:1")
    with pytest.raises(InvalidRequest, match=r"^TORCHFT_LIGHTHOUSE='http://\[bad:1' is not "
                       r"a URL \(Invalid IPv6 URL\): set it .*CkptdTransport\(advertise_host="):
        CkptdTransport(60, shm_dir=str(shm))
    assert not any(p for p in shm.rglob("*") if p.is_file())  # (its pool is gone)
    named: CkptdTransport[Any] = CkptdTransport(60, advertise_host="127.0.0.1",
                                                shm_dir=str(shm))
    named.shutdown()  # (given the address, the lighthouse is not asked)
    for value in ("http://no-such-host.invalid:29510", "no-such-host.invalid:29510"):
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", value)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptd.client.integrations.torchft"):
            two = [CkptdTransport(60, shm_dir=str(shm)) for _ in range(2)]
        for t in two:
            assert json.loads(t.metadata())["url"].startswith("http://127.0.0.1:")
            t.shutdown()
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1, said  # once
        assert "127.0.0.1 (loopback), which replica groups on other hosts cannot reach" \
            in said[0]
        assert repr(value) in said[0] and "CkptdTransport(advertise_host=...)" in said[0]
    assert "has no scheme" in said[0]
