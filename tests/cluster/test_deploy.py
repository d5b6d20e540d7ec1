"""The deployment: one image (the root Dockerfile, whose HEALTHCHECK is run here
against a real ``ckptd serve`` configured as the image configures it, over http
and https), compose, and the local script that starts three replicas over an
S3-compatible server (moto's here), used end to end. The Kubernetes manifests:
test_deploy_kubernetes.py.

No Docker here: nothing is built; the image's own commands are run instead."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from ckptd import __version__
from ckptd.client import Checkpointer
from tests.cluster.conftest import BUCKET, ROOT, s3_env
from tests.conftest import free_port
from tests.integration.test_install import instructions
from tests.integration.test_tls import make_certificate
from tests.moto_server import moto_server

DEPLOY = ROOT / "deploy"
IMAGE_NAME = "ckptd"  # the name manifests and compose give the image the Dockerfile builds


def dockerfile() -> dict[str, list[str]]:
    """The root Dockerfile's final stage: its ENV, HEALTHCHECK, ENTRYPOINT and CMD."""
    image: dict[str, list[str]] = {"ENV": [], "USER": []}
    for word, args in instructions((ROOT / "Dockerfile").read_text()):
        if word == "FROM":
            image = {"ENV": [], "USER": []}
        elif word == "ENV":
            image["ENV"] += [f"{k}={v}" for k, v in re.findall(r"(\w+)=(\S+)", args)]
        elif word == "USER":
            image["USER"] = [args]
        elif word == "HEALTHCHECK":
            image[word] = json.loads(args.split(" CMD ", 1)[1])
        elif word in ("ENTRYPOINT", "CMD"):
            image[word] = json.loads(args)
    return image


def test_one_image_whose_command_serves_and_never_runs_as_root() -> None:
    assert list(DEPLOY.rglob("Dockerfile*")) == []  # one image: the root Dockerfile's
    image = dockerfile()
    assert image["ENTRYPOINT"] + image["CMD"] == ["ckptd", "serve"]
    # A user the image makes, by number (Kubernetes checks runAsNonRoot against a
    # number only), who owns /data.
    (user,) = image["USER"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user
    uid, gid = user.split(":")
    made = [args for word, args in instructions((ROOT / "Dockerfile").read_text())
            if word == "RUN" and "useradd" in args]
    assert len(made) == 1 and f"--uid {uid}" in made[0] and f"--gid {gid}" in made[0], made
    assert f"chown {uid}:{gid} /data" in made[0]
    # The Kubernetes pods run as that user (deploy/kubernetes/base).
    pods = [d["spec"]["template"]["spec"] for d in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "base" / "ckptd.yaml").read_text()) if d["kind"] == "StatefulSet"]
    assert [(p["securityContext"]["runAsUser"], p["securityContext"]["fsGroup"])
            for p in pods] == [(int(uid), int(gid))]
    env = dict(e.split("=", 1) for e in image["ENV"])
    assert env["CKPTD_HOST"] == "0.0.0.0" and env["CKPTD_PORT"] == "8470"
    text = (ROOT / "Dockerfile").read_text()
    # The pinned CPU build of torch by default, a build argument for a CUDA one.
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r'torch==\$\{TORCH_VERSION\}', text)
    assert f"ARG TORCH_VERSION={torch.__version__.split('+')[0]}" in text


def _serve_like_the_image(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes],
                                                                         Path]:
    """The image's ENTRYPOINT and CMD, configured as the image is: by CKPTD_* only."""
    image = dockerfile()
    command = image["ENTRYPOINT"] + image.get("CMD", [])
    log = tmp_path / f"serve-{env['CKPTD_PORT']}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path)
    return proc, log


def _image_env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.update(e.split("=", 1) for e in dockerfile()["ENV"])  # the image's own
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # where ckptd is
    # Loopback only in tests: the image's 0.0.0.0 would serve every interface.
    env.update(CKPTD_HOST="127.0.0.1", CKPTD_PORT=str(free_port()),
               CKPTD_STORE=str(tmp_path / "store"), **more)
    return env


def _healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dockerfile()["HEALTHCHECK"], env=env, capture_output=True, text=True,
                          timeout=30)


def _takes_connections(port: str) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (a connection, no ckptd process)."""
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def make_service_certificate(where: Path) -> tuple[Path, Path]:
    """A certificate as a cluster's CA issues one: for the service's name (not the
    loopback address the check asks on), signed by a CA the file does not hold."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def build(subject: str, issuer: str, public: Any, signer: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(public).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("ckptd.ml.svc.cluster.local")]),
                critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    build("cluster CA", "cluster CA", ca_key.public_key(), ca_key, True)  # kept elsewhere
    leaf = build("ckptd", "cluster CA", key.public_key(), ca_key, False)
    cert_path, key_path = where / "leaf.pem", where / "leaf-key.pem"
    cert_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.parametrize("tls", ["", "self-signed", "issued"],
                         ids=["http", "https-self-signed", "https-issued-for-the-service"])
def test_the_image_health_check_follows_the_configured_port_and_tls(
    tmp_path: Path, tls: str
) -> None:
    more = {}
    if tls:
        maker = make_certificate if tls == "self-signed" else make_service_certificate
        cert, key = maker(tmp_path)
        more = {"CKPTD_TLS_CERT": str(cert), "CKPTD_TLS_KEY": str(key)}
    env = _image_env(tmp_path, **more)
    assert env["CKPTD_PORT"] != "8470"  # another port than the image's default
    # Before the server answers: unhealthy (exit 1, Docker's "unhealthy").
    early = _healthcheck(env)
    assert early.returncode == 1, early.stdout + early.stderr
    proc, log = _serve_like_the_image(tmp_path, env)
    picks = 3  # (a port free when picked can be taken before the server binds it)
    try:
        deadline = time.monotonic() + 60
        # The check (a process: imports, ~0.5 s of CPU) is run once the port takes
        # connections, not every 0.3 s while the server starts.
        while (proc.poll() is None and time.monotonic() < deadline
               and not _takes_connections(env["CKPTD_PORT"])):
            time.sleep(0.05)
        while (done := _healthcheck(env)).returncode != 0:
            if proc.poll() is not None and "already in use" in log.read_text() and picks:
                picks -= 1
                env["CKPTD_PORT"] = str(free_port())
                proc, log = _serve_like_the_image(tmp_path, env)
                continue
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, done.stdout + done.stderr + log.read_text()
            time.sleep(0.3)
        scheme = "https" if tls else "http"
        assert f"{scheme}://127.0.0.1:{env['CKPTD_PORT']}/healthz" in done.stdout
        # A proxy in the environment (for the object store) is not asked for loopback.
        nowhere = f"http://127.0.0.1:{free_port()}"
        proxied = _healthcheck({**env, **{name: nowhere for name in (
            "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}})
        assert proxied.returncode == 0, proxied.stdout + proxied.stderr
        assert f"on {scheme}://127.0.0.1:{env['CKPTD_PORT']}" in log.read_text()
        if tls:  # the check speaks https because the server does, not by luck
            plain = _healthcheck({k: v for k, v in env.items() if not k.startswith("CKPTD_TLS")})
            assert plain.returncode == 1, plain.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    late = _healthcheck(env)
    assert late.returncode == 1 and "unhealthy" in late.stderr, late.stdout + late.stderr


def test_compose_file_matches_the_manifests() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = [s for name, s in services.items() if name.startswith("ckptd-")]
    assert len(replicas) == 3 and "minio" in services
    peers = {s["environment"]["CKPTD_PEERS"] for s in replicas}
    assert len(peers) == 1
    assert len({s["environment"]["CKPTD_PEER_SECRET"] for s in replicas}) == 1
    assert sorted(s["environment"]["CKPTD_ADVERTISE_URL"] for s in replicas) == sorted(
        peers.pop().split(","))
    # The image is a parameter (CKPTD_IMAGE), by default the one the root Dockerfile builds.
    assert {s["image"] for s in replicas} == {f"${{CKPTD_IMAGE:-{IMAGE_NAME}:{__version__}}}"}
    assert {s["build"]["context"] for s in replicas} == {"../.."}
    assert (DEPLOY / "compose" / "../.." / "Dockerfile").resolve() == ROOT / "Dockerfile"


def test_compose_health_checks_use_commands_their_images_have() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, service in services.items():
        if name.startswith("ckptd-"):
            # ckptd's own check, which reads the port and TLS from the environment:
            # so no --port or --tls-* among the arguments, where it cannot see them.
            assert service["healthcheck"]["test"] == ["CMD", *dockerfile()["HEALTHCHECK"]]
            assert not any(a.startswith(("--port", "--tls", "--host"))
                           for a in service.get("command", [])), service["command"]
    # MinIO's images ship mc (MinIO's own compose example checks with it), not curl.
    assert services["minio"]["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]
    checks = json.dumps([s.get("healthcheck") for s in services.values()])
    assert "curl" not in checks and "wget" not in checks


def test_compose_is_a_local_demo() -> None:
    """Its credentials are in the file: the replicas are published on loopback only.
    Docker waits out the server's drain on stop; health checks (a process each) are
    not run every few seconds; restores read through the replicas, since presigned
    URLs would name minio:9000, which clients on the host cannot resolve."""
    from ckptd.server.app import GRACEFUL_SHUTDOWN_S
    from ckptd.server.settings import Settings

    text = (DEPLOY / "compose" / "docker-compose.yml").read_text()
    assert "local demo" in text
    services = yaml.safe_load(text)["services"]
    replicas = [s for name, s in services.items() if name.startswith("ckptd-")]
    assert len(replicas) == 3
    for service in replicas:
        (published,) = service["ports"]
        assert published.startswith("127.0.0.1:") and published.endswith(":8470"), published
        assert seconds(service["stop_grace_period"]) > GRACEFUL_SHUTDOWN_S
        assert seconds(service["healthcheck"]["interval"]) >= 15
        env = service["environment"]
        assert env["CKPTD_PRESIGNED_READS"] == "false"
        assert "endpoint=http://minio:9000" in env["CKPTD_STORE"]
        for var in env:  # (an unknown CKPTD_* would be ignored)
            if var.startswith("CKPTD_"):
                assert var.removeprefix("CKPTD_").lower() in Settings.model_fields, var
    assert "ports" not in services["minio"]


def seconds(duration: str) -> float:
    """A compose duration of one unit ("40s", "1m")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, duration
    value, unit = match.groups()
    return float(value) * {"ms": 0.001, "s": 1, "m": 60}[unit]


def _run_the_local_cluster(env: dict[str, str], tmp_path: Path, shm: Path,
                           ports: list[int]) -> None:
    """Runs deploy/compose/local-cluster.sh until it says ready, saves and restores
    through its replicas, stops it, and checks that every replica stopped with it."""
    errors = tmp_path / "script.err"
    with errors.open("wb") as sink:
        proc = subprocess.Popen(["bash", str(DEPLOY / "compose" / "local-cluster.sh")], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=sink,
                                start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("ready "), (line, errors.read_text(errors="replace")[-3000:])
        urls = line.removeprefix("ready ")
        assert urls.split(",") == [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls.split(","):
            # ready: each replica's store answers (a 503 is not ready)
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            doc = httpx.get(f"{url}/v1/cluster", timeout=10).json()
            assert doc["mode"] == "static" and len(doc["members"]) == 3
        assert all((tmp_path / "logs" / f"ckptd-{p}.log").exists() for p in ports)
        state = {"w": torch.arange(50_000, dtype=torch.float32)}
        with Checkpointer(urls, "deploy", chunk_size=16384, serve_peers=False,
                          shm_dir=shm) as ckpt:
            assert ckpt.save(1, state).wait(timeout=120).state == "committed"
            target = {"w": torch.zeros(50_000)}
            ckpt.restore(target)
        assert torch.equal(target["w"], state["w"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # Every replica stopped with the script.
    time.sleep(0.5)
    for port in ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


def _script_env(tmp_path: Path, ports: list[int], **more: str) -> dict[str, str]:
    return {**s3_env(), "PYTHON": sys.executable, "PORTS": " ".join(map(str, ports)),
            # (a LOG_DIR not there yet is made: found by a probe)
            "LOG_DIR": str(tmp_path / "logs"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **more}


@pytest.mark.slow
def test_local_cluster_script_runs_three_replicas_over_moto(tmp_path: Path, shm: Path) -> None:
    ports = [free_port() for _ in range(3)]
    _run_the_local_cluster(_script_env(tmp_path, ports, S3_PORT=str(free_port())),
                           tmp_path, shm, ports)


@pytest.mark.slow
def test_local_cluster_script_over_an_s3_you_run_needs_no_boto3(tmp_path: Path,
                                                                 shm: Path) -> None:
    """ckptd's S3 extra brings botocore, not boto3: the script makes the bucket with
    botocore, and only when it is not there (it imported boto3 and failed)."""
    shadow = tmp_path / "no-boto3" / "boto3"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError('boto3 is not installed (the test hides it)')\n")
    ports = [free_port() for _ in range(3)]
    with moto_server("tests.cluster.moto_s3", BUCKET, s3_env(), tmp_path) as endpoint:
        env = _script_env(tmp_path, ports, S3_ENDPOINT=endpoint, BUCKET="made-by-the-script",
                          PYTHONPATH=str(shadow.parent))
        _run_the_local_cluster(env, tmp_path, shm, ports)
        # Again over the bucket it made, which it keeps.
        ports[:] = [free_port() for _ in range(3)]
        env.update(PORTS=" ".join(map(str, ports)), PREFIX="again")  # (step 1 is saved)
        _run_the_local_cluster(env, tmp_path, shm, ports)


def test_the_health_check_reaches_a_wildcard_bind_on_loopback() -> None:
    from ckptd.cli.healthcheck import probe_url

    assert probe_url("0.0.0.0", 8470, False) == "http://127.0.0.1:8470/healthz"
    assert probe_url("::", 9000, True) == "https://[::1]:9000/healthz"
    assert probe_url("fd00::7", 1, False) == "http://[fd00::7]:1/healthz"
    assert probe_url("ckptd-0.ckptd", 8470, False) == "http://ckptd-0.ckptd:8470/healthz"


def test_the_health_check_names_a_bad_setting_in_a_line(tmp_path: Path) -> None:
    """(Found by a probe: a certificate without its key was told as a variable
    "CKPTD_:".)"""
    env = _image_env(tmp_path)
    done = _healthcheck({**env, "CKPTD_TLS_CERT": str(tmp_path / "cert.pem")})
    assert done.returncode != 0
    said = (done.stdout + done.stderr).strip()
    assert "CKPTD_:" not in said and "give both CKPTD_TLS_CERT and CKPTD_TLS_KEY" in said, said
    assert len(said.splitlines()) == 1, said
    done = _healthcheck({**env, "CKPTD_PORT": "abc"})
    assert done.returncode != 0 and "CKPTD_PORT" in done.stdout + done.stderr
