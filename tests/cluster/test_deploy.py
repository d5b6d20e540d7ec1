"""The deployment: Kubernetes manifests (a StatefulSet of replicas behind a
headless Service, a Secret, MinIO) and the local script that starts three
replicas over an S3-compatible server (moto's here), used end to end."""

from __future__ import annotations

import os
import signal
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
from tests.cluster.conftest import ROOT, s3_env
from tests.conftest import free_port

DEPLOY = ROOT / "deploy"


def documents(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(path.read_text()) if d}


def test_kubernetes_manifests() -> None:
    k8s = DEPLOY / "kubernetes"
    docs = {**documents(k8s / "secret.yaml"), **documents(k8s / "minio.yaml"),
            **documents(k8s / "ckptd.yaml")}
    kustomize = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    assert sorted(kustomize["resources"]) == ["ckptd.yaml", "minio.yaml", "secret.yaml"]

    service, sts = docs["Service", "ckptd"], docs["StatefulSet", "ckptd"]
    assert service["spec"]["clusterIP"] == "None"  # headless: stable per-replica names
    assert sts["spec"]["serviceName"] == "ckptd"
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/ckptd/ckptd:{__version__}"  # pinned, not :latest
    assert container["ports"] == [{"name": "http", "containerPort": 8470}]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}

    env = {e["name"]: e for e in container["env"]}
    assert env["CKPTD_HOST"]["value"] == "0.0.0.0"
    assert env["CKPTD_STORE"]["value"].startswith("s3://ckptd/")
    assert "endpoint=http://minio:9000" in env["CKPTD_STORE"]["value"]
    # One peer per replica, by the StatefulSet's stable names, on the served port.
    replicas = sts["spec"]["replicas"]
    assert env["CKPTD_PEERS"]["value"].split(",") == [
        f"http://ckptd-{i}.ckptd:{env['CKPTD_PORT']['value']}" for i in range(replicas)]
    assert env["CKPTD_ADVERTISE_URL"]["value"] == "http://$(POD_NAME).ckptd:8470"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    secret = docs["Secret", "ckptd"]["stringData"]
    for name, key in (("CKPTD_TOKEN", "token"), ("AWS_ACCESS_KEY_ID", "s3-access-key-id"),
                      ("AWS_SECRET_ACCESS_KEY", "s3-secret-access-key")):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "ckptd", "key": key}
        assert key in secret
    # The settings the manifests name exist (an unknown CKPTD_* would be ignored).
    from ckptd.server.settings import Settings
    for name in env:
        if name.startswith("CKPTD_"):
            assert name.removeprefix("CKPTD_").lower() in Settings.model_fields, name

    minio = docs["Deployment", "minio"]["spec"]["template"]["spec"]["containers"][0]
    assert minio["readinessProbe"]["httpGet"]["path"] == "/minio/health/ready"
    assert docs["Service", "minio"]["spec"]["ports"][0]["port"] == 9000
    assert "mc mb" in str(docs["Job", "minio-make-bucket"])


def test_compose_file_matches_the_manifests() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = [s for name, s in services.items() if name.startswith("ckptd-")]
    assert len(replicas) == 3 and "minio" in services
    peers = {s["environment"]["CKPTD_PEERS"] for s in replicas}
    assert len(peers) == 1
    assert sorted(s["environment"]["CKPTD_ADVERTISE_URL"] for s in replicas) == sorted(
        peers.pop().split(","))
    assert {s["image"] for s in replicas} == {f"ghcr.io/ckptd/ckptd:{__version__}"}


@pytest.mark.slow
def test_local_cluster_script_runs_three_replicas_over_moto(tmp_path: Path, shm: Path) -> None:
    ports = [free_port() for _ in range(3)]
    env = {**s3_env(), "PYTHON": sys.executable, "PORTS": " ".join(map(str, ports)),
           "S3_PORT": str(free_port()), "LOG_DIR": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(DEPLOY / "compose" / "local-cluster.sh")], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("ready "), line
        urls = line.removeprefix("ready ")
        assert urls.split(",") == [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls.split(","):
            doc = httpx.get(f"{url}/v1/cluster", timeout=10).json()
            assert doc["mode"] == "static" and len(doc["members"]) == 3
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
