"""The Kubernetes manifests: ``deploy/kubernetes/base`` (the replicas: a StatefulSet
behind a headless Service), ``example`` (base with a MinIO that keeps its data and
a placeholder Secret, for a laptop cluster) and ``production`` (base at production
sizes, a disruption budget, one replica per node, no Secret and no MinIO).

What ``kubectl kustomize`` builds is checked where kubectl is on PATH (the
production overlay, which named the folder holding it, did not build: "cycle
detected"); the layout, the base's own manifest and the paths the docs name are
checked always."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd import __version__
from tests.cluster.conftest import ROOT
from tests.cluster.test_deploy import dockerfile

K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not on PATH: the kustomizations are not built")
UID = 10001  # the image's user, the owner of /data (test_deploy.py checks the Dockerfile)
SECRET_KEYS = {"CKPTD_TOKEN": "token", "CKPTD_PEER_SECRET": "peer-secret",
               "AWS_ACCESS_KEY_ID": "s3-access-key-id",
               "AWS_SECRET_ACCESS_KEY": "s3-secret-access-key"}


def read(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def build(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """What ``kubectl kustomize folder`` builds, by (kind, name)."""
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return by_kind(list(yaml.safe_load_all(done.stdout)))


def cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def mebibytes(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_no_kustomization_uses_a_folder_that_holds_it() -> None:
    """kustomize refuses a resource folder that contains the kustomization naming it
    ("cycle detected"): production's `..` did."""
    found = {k.parent.relative_to(K8S).as_posix() for k in K8S.rglob("kustomization.yaml")}
    for name in sorted(found):
        here = (K8S / name).resolve()
        for entry in yaml.safe_load((here / "kustomization.yaml").read_text())["resources"]:
            target = (here / entry).resolve()
            assert target.exists(), (name, entry)
            assert not (target.is_dir() and here.is_relative_to(target)), (name, entry)
    assert found == {"base", "example", "production"}
    # The overlays use base alone: production holds nothing of the example's.
    for name in ("example", "production"):
        resources = yaml.safe_load((K8S / name / "kustomization.yaml").read_text())["resources"]
        assert "../base" in resources
        assert not any("example" in r for r in resources if name == "production"), resources


def the_replicas(docs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """Checks the replicas (as the base defines them or an overlay builds them) and
    returns their container."""
    service, sts = docs["Service", "ckptd"], docs["StatefulSet", "ckptd"]
    assert service["spec"]["clusterIP"] == "None"  # headless: stable per-replica names
    assert sts["spec"]["serviceName"] == "ckptd"
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ckptd:{__version__}"  # a local build's, never :latest
    assert container["imagePullPolicy"] == "IfNotPresent"  # `kind load docker-image` works
    assert container["args"][0] == "serve"  # after the image's ENTRYPOINT, ckptd
    assert dockerfile()["ENTRYPOINT"] == ["ckptd"]
    assert container["ports"] == [{"name": "http", "containerPort": 8470}]
    assert service["spec"]["ports"][0]["targetPort"] == "http"

    # Liveness never asks the store (a store outage restarted every replica);
    # readiness does, and waits for its 2 s store probe.
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["timeoutSeconds"] >= 3, probe
    from ckptd.server.app import GRACEFUL_SHUTDOWN_S
    assert pod["terminationGracePeriodSeconds"] > GRACEFUL_SHUTDOWN_S

    # Not root, by number (the image's USER), nothing more than the server needs.
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}

    env = {e["name"]: e for e in container["env"]}
    order = [e["name"] for e in container["env"]]
    # Kubernetes expands $(VAR) only for a VAR defined earlier in the same list
    # (a patch's new items go first: found building the example).
    for i, item in enumerate(container["env"]):
        for var in re.findall(r"\$\((\w+)\)", item.get("value", "")):
            assert var in order[:i], f"{item['name']} uses $({var}) before its definition"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["CKPTD_HOST"]["value"] == "0.0.0.0"
    # One peer per replica, by names a job in any namespace resolves, on the port.
    port = env["CKPTD_PORT"]["value"]
    peers = env["CKPTD_PEERS"]["value"].split(",")
    assert peers == [f"http://ckptd-{i}.ckptd.$(POD_NAMESPACE).svc:{port}"
                     for i in range(sts["spec"]["replicas"])]
    advertised = env["CKPTD_ADVERTISE_URL"]["value"]
    assert advertised == f"http://$(POD_NAME).ckptd.$(POD_NAMESPACE).svc:{port}"
    assert advertised.replace("$(POD_NAME)", "ckptd-0") in peers
    for name, key in SECRET_KEYS.items():
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "ckptd", "key": key}
    # The settings the manifests name exist (an unknown CKPTD_* would be ignored).
    from ckptd.server.settings import Settings
    for name in env:
        if name.startswith("CKPTD_"):
            assert name.removeprefix("CKPTD_").lower() in Settings.model_fields, name
    # The memory limit holds the server's default budgets (~70 MB idle besides).
    defaults = Settings.model_fields
    budgets = sum(int(defaults[f].default) for f in (
        "ingest_budget", "egress_budget", "manifest_cache_bytes")) / 2**20 + 70
    assert mebibytes(container["resources"]["limits"]["memory"]) >= budgets
    return container


def test_the_base_manifest_alone() -> None:
    """(Always run: the base's own file, as written.)"""
    kustomize = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert kustomize["resources"] == ["ckptd.yaml"]
    assert kustomize["images"] == [{"name": "ckptd", "newTag": __version__}]
    docs = by_kind(read(K8S / "base" / "ckptd.yaml"))
    assert set(docs) == {("Service", "ckptd"), ("StatefulSet", "ckptd")}
    container = the_replicas(docs)
    # A laptop's request (3 replicas and MinIO on kind or minikube).
    requests = container["resources"]["requests"]
    assert cpu(requests["cpu"]) <= 0.5 and mebibytes(requests["memory"]) <= 1024
    assert mebibytes(container["resources"]["limits"]["memory"]) <= 4096


@needs_kubectl
def test_the_example_builds_with_minio_that_keeps_its_data() -> None:
    docs = build(K8S / "example")
    container = the_replicas(docs)
    env = {e["name"]: e for e in container["env"]}
    assert env["CKPTD_STORE"]["value"] == (
        "s3://ckptd/checkpoints?endpoint=http://minio.$(POD_NAMESPACE).svc:9000")
    secret = docs["Secret", "ckptd"]["stringData"]
    assert set(SECRET_KEYS.values()) <= set(secret)
    minio = docs["StatefulSet", "minio"]
    assert [c["metadata"]["name"] for c in minio["spec"]["volumeClaimTemplates"]] == ["data"]
    pod = minio["spec"]["template"]["spec"]
    assert "volumes" not in pod  # (no emptyDir: the data is on the claim)
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/minio/health/ready"
    assert docs["Service", "minio"]["spec"]["ports"][0]["port"] == 9000
    assert "mc mb --ignore-existing store/ckptd" in str(docs["Job", "minio-make-bucket"])


@needs_kubectl
def test_production_builds_without_the_demo() -> None:
    docs = build(K8S / "production")
    container = the_replicas(docs)
    # No Secret (created outside git, never overwritten by an apply), nothing of MinIO.
    assert {kind for kind, _ in docs} == {"Service", "StatefulSet", "PodDisruptionBudget"}
    assert not any("minio" in name for _, name in docs)
    env = {e["name"]: e for e in container["env"]}
    assert "minio" not in env["CKPTD_STORE"]["value"]
    budget = docs["PodDisruptionBudget", "ckptd"]["spec"]
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "ckptd"}}}
    pod = docs["StatefulSet", "ckptd"]["spec"]["template"]["spec"]
    (spread,) = pod["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert spread == {"labelSelector": {"matchLabels": {"app": "ckptd"}},
                      "topologyKey": "kubernetes.io/hostname"}
    resources = container["resources"]
    assert cpu(resources["requests"]["cpu"]) >= 4
    assert mebibytes(resources["requests"]["memory"]) >= 4096
    # The sizes the operations page gives are the ones the overlay sets.
    operations = (ROOT / "docs" / "operations.md").read_text()
    for value in (resources["requests"]["cpu"], resources["requests"]["memory"],
                  resources["limits"]["memory"]):
        assert f"{value}" in operations, value


def test_the_deploy_paths_the_docs_name_are_there() -> None:
    """(The manifests moved: every deploy/ path a page names must still be there.)"""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {m.rstrip(".,)") for page in pages
             for m in re.findall(r"deploy/[\w./-]+", page.read_text())}
    assert "deploy/kubernetes/example" in named and "deploy/kubernetes/production" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], missing
    operations = (ROOT / "docs" / "operations.md").read_text()
    for command in ("kubectl apply -k deploy/kubernetes/example",
                    "kubectl apply -k deploy/kubernetes/production",
                    "kubectl create secret generic ckptd",
                    "kubectl rollout restart statefulset/ckptd"):
        assert command in operations, command
