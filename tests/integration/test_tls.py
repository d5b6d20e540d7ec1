"""TLS: ``ckptd serve --tls-cert/--tls-key`` serves https://, the client trusts it
through a CA bundle (``ca_bundle=`` or ``CKPTD_CA_BUNDLE``), and an https:// URL
pointed at a plain-HTTP server (or at an untrusted certificate) says so at once
instead of retrying. The certificate is made here, self-signed."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.transport import open_transport
from ckptd.errors import InvalidRequest
from tests.conftest import free_port

if TYPE_CHECKING:
    from tests.conftest import ServerProcess


def make_certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (its own CA) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptd test")])
    now = dt.datetime.now(dt.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")
        ]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = where / "cert.pem", where / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``ckptd serve`` over https:// on 127.0.0.1; (its URL, the CA bundle)."""
    cert, key = make_certificate(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--store", str(tmp_path / "store"),
             "--host", "127.0.0.1", "--port", str(port), "--tls-cert", str(cert),
             "--tls-key", str(key)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                trust = ssl.create_default_context(cafile=str(cert))
                if httpx.get(f"{url}/healthz", verify=trust, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        assert f"on https://127.0.0.1:{port}" in log_path.read_text()
        yield url, cert
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _latest(url: str, job: str, **kwargs: str) -> int | None:
    """``latest(job)`` through a fresh transport to ``url`` (``kwargs``: its options)."""
    async def latest() -> int | None:
        transport = open_transport(url, **kwargs)
        try:
            return await transport.latest(job)
        finally:
            await transport.close()

    return asyncio.run(latest())


def test_checkpointer_saves_and_restores_over_https(
    tls_server: tuple[str, Path], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca = tls_server
    monkeypatch.setenv("CKPTD_CA_BUNDLE", str(ca))
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with Checkpointer(url, job="tls", shm_dir=shm, heartbeat_interval=0.2) as ckpt:
        assert ckpt.save(3, state).wait(60).state == "committed"
        back = {"w": torch.zeros(1000)}
        ckpt.restore(back)
        assert torch.equal(back["w"], state["w"])
        # heartbeats get through over TLS too
        deadline = time.monotonic() + 20
        while ckpt.heartbeat is not None and ckpt.heartbeat.beats == 0:
            assert time.monotonic() < deadline, "no heartbeat got through over https"
            time.sleep(0.1)
    env = {**os.environ, "CKPTD_CA_BUNDLE": str(ca)}
    for command in (["ls", "tls"], ["status", "tls"]):
        done = subprocess.run([sys.executable, "-m", "ckptd", *command, "--url", url],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_open_transport_takes_a_ca_bundle(
    tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca = tls_server
    monkeypatch.delenv("CKPTD_CA_BUNDLE", raising=False)

    assert _latest(url, "nothing", ca_bundle=str(ca)) is None
    # without it the certificate is untrusted: said once, with what to do
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="CKPTD_CA_BUNDLE"):
        _latest(url, "nothing")
    assert time.monotonic() - started < 5


def test_https_against_plain_http_says_so_at_once(server: ServerProcess) -> None:
    url = server.url.replace("http://", "https://")

    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="speaks plain HTTP") as raised:
        _latest(url, "job")
    assert time.monotonic() - started < 5, "retried instead of saying what is wrong"
    assert "--tls-cert" in str(raised.value) and "http://127.0.0.1" in str(raised.value)
    assert "docs/operations.md, 'TLS'" in str(raised.value)  # (a section that is there)
    for command in (["ls"], ["status"]):
        done = subprocess.run([sys.executable, "-m", "ckptd", *command, "--url", url],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "speaks plain HTTP" in done.stderr and "Traceback" not in done.stderr


def test_serve_refuses_a_certificate_it_cannot_load(tmp_path: Path) -> None:
    cert, _ = make_certificate(tmp_path)
    for extra in (["--tls-cert", str(cert)], ["--tls-cert", str(cert), "--tls-key", str(cert)]):
        done = subprocess.run(
            [sys.executable, "-m", "ckptd", "serve", "--store", str(tmp_path / "s"),
             "--port", "0", *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "tls" in done.stderr.lower() and "Traceback" not in done.stderr


def test_http_against_a_tls_server_says_so_at_once(tls_server: tuple[str, Path]) -> None:
    """(Found by a probe: five tries, then "Server disconnected without sending a
    response", and nothing said to use https://.)"""
    url = tls_server[0].replace("https://", "http://")

    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="speaks TLS") as raised:
        _latest(url, "job")
    assert time.monotonic() - started < 5, "retried instead of saying what is wrong"
    assert "use https://127.0.0.1" in str(raised.value), raised.value
    done = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url", url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "speaks TLS" in done.stderr and "Traceback" not in done.stderr, done.stderr
