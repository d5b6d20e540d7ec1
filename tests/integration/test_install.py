"""A plain (non-editable) install works: the Dockerfile's steps replayed without
Docker build the wheel, install it into a fresh virtual environment, and from a
directory outside the checkout ``ckptd serve`` serves a save, a restore and a
``ckptd verify``; the image's health check passes against its entrypoint.

Slow (a fresh environment, a wheel built and installed): one module-scoped
environment serves every test here. It needs the package index, as the README's
set-up commands do."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# Import name -> source folder: the layout setup.py maps (see README "Layout").
ROOTS = {"ckptd": "ckptd", "ckptd/client": "client", "ckptd/server": "server"}
# Package data: what the server reads from its own package at run time.
DATA = {"server": ("static", "templates")}
# The image's torch line: the pinned version, which the README's first set-up step
# installs into the checkout's environment too (the image's CPU index URL need not be
# reachable from CI).
TORCH = "torch==2.13.0"


@dataclass
class Image:
    """What replaying the Dockerfile left: the environment and the final stage."""

    root: Path  # stands for "/" of the image
    venv: Path
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    user: str | None = None
    users: dict[str, int] = field(default_factory=dict)
    healthcheck: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    wheels: list[Path] = field(default_factory=list)

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _map_paths(text: str, image: Image, roots: set[str]) -> str:
    for root in sorted(roots, key=len, reverse=True):
        text = re.sub(rf"(?<![\w/.]){re.escape(root)}(?=$|[/\s\"')])", str(image.path(root)),
                      text)
    return text


def _link_torch(venv: Path) -> None:
    """The image's torch step: this environment's torch (the pinned build), visible
    read-only to the fresh one through a .pth file, as an installed distribution to
    pip there too. Installing it again wrote ~750 MB: tens of seconds of a loaded CI
    machine's disk and CPU that test nothing of ckptd. Its dependencies are not
    linked: the wheel's install step installs them from the index, as in the image."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    torch = distribution("torch")
    assert Requirement(TORCH).specifier.contains(torch.version, prereleases=True), (
        f"this environment's torch is {torch.version}, the image pins {TORCH}")
    site = venv.parent / "torch-site"
    site.mkdir()
    origin = Path(str(torch.locate_file("")))
    tops = {Path(str(f)).parts[0] for f in torch.files or []} - {".."}  # (.. : bin/)
    assert "torch" in tops, tops
    for top in tops:
        (site / top).symlink_to(origin / top)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "ckptd-test-torch.pth").write_text(f"{site}\n")


def replay(dockerfile: Path, image: Image, log: list[str]) -> None:
    """Runs the Dockerfile's steps in ``image.root`` with one virtual environment
    standing for the base image's Python."""
    steps = instructions(dockerfile.read_text())
    roots: set[str] = set()
    for word, args in steps:  # every absolute path the steps name lives under root
        if word in ("WORKDIR", "COPY", "RUN", "ENV"):
            roots.update(m for m in re.findall(r"(?<![\w.:/])(/[a-z]+)(?=[/\s\"']|$)", args)
                         if m not in ("/dev",))
    env = {**os.environ, "PATH": f"{image.venv / 'bin'}:{os.environ['PATH']}"}
    # No .pyc compiled at install: the dependencies' thousands of modules (botocore,
    # sympy, numpy) cost seconds of the CI machine's CPU that nothing here needs
    # (what is installed is the same).
    env["PIP_COMPILE"] = "false"  # (PIP_NO_COMPILE=1 does not turn it off)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    cwd = image.root
    for word, args in steps:
        if word == "FROM":
            cwd = image.root
        elif word == "WORKDIR":
            cwd = image.path(args)
            cwd.mkdir(parents=True, exist_ok=True)
            image.workdir = cwd
        elif word == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                image.env[key] = value
        elif word == "COPY":
            parts = shlex.split(args)
            from_stage = any(p.startswith("--from=") for p in parts)
            parts = [p for p in parts if not p.startswith("--")]
            *sources, dest = parts
            target = image.path(dest) if dest.startswith("/") else cwd / dest
            for src in sources:
                origin = image.path(src) if from_stage else REPO / src
                into = target / origin.name if dest.endswith("/") else target
                if origin == into:
                    continue  # a stage's folder to the same folder of the next stage
                if origin.is_dir():
                    shutil.copytree(origin, into, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, into)
        elif word == "RUN":
            if "useradd" in args:
                # Creating a system user needs root and changes this machine: read
                # the user and uid it creates instead.
                name = args.split("useradd", 1)[1].split("&&", 1)[0].split()[-1]
                uid = re.search(r"--uid\s+(\d+)", args)
                image.users[name] = int(uid.group(1)) if uid else -1
                continue
            if re.search(r"pip install .*torch==", args):
                _link_torch(image.venv)
                log.append(f"RUN {args}: {TORCH} of this environment, linked")
                continue
            command = _map_paths(args, image, roots)
            log.append(f"RUN {command}")
            done = subprocess.run(["sh", "-c", command], cwd=cwd, env=env, text=True,
                                  capture_output=True, timeout=800)
            assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            if "pip wheel" in args:
                # Kept aside: the image deletes its copy once installed.
                kept = image.root.parent / "built"
                kept.mkdir(exist_ok=True)
                for whl in image.path("/wheels").glob("*.whl"):
                    image.wheels.append(Path(shutil.copy2(whl, kept)))
        elif word == "USER":
            image.user = args
        elif word == "HEALTHCHECK":
            image.healthcheck = json.loads(args.split("CMD", 1)[1].strip())
        elif word == "ENTRYPOINT":
            image.entrypoint = json.loads(args)
        elif word == "CMD":
            image.cmd = json.loads(args)
    image.env = {k: _map_paths(v, image, roots) for k, v in image.env.items()}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    base = tmp_path_factory.mktemp("image")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    img = Image(root=base / "root", venv=venv)
    img.root.mkdir()
    log: list[str] = []
    replay(REPO / "Dockerfile", img, log)
    # The wheel copied on, as the image keeps only it: built in the first stage.
    assert img.wheels, f"the Dockerfile built no wheel: {log}"
    yield img


def _expected_files() -> set[str]:
    expected: set[str] = set()
    for name, folder in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder)
            if "__pycache__" in rel.parts or (folder == "ckptd" and rel.parts[0] in ROOTS):
                continue
            expected.add(f"{name}/{rel.as_posix()}")
    for folder, subdirs in DATA.items():
        for sub in subdirs:
            for path in (REPO / folder / sub).rglob("*"):
                if path.is_file():
                    expected.add(f"ckptd/{folder}/{path.relative_to(REPO / folder).as_posix()}")
    return expected


def test_wheel_holds_every_module_and_package_file(image: Image) -> None:
    (wheel,) = image.wheels
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if ".dist-info/" not in n}
    expected = _expected_files()
    assert names == expected, (
        f"missing from the wheel: {sorted(expected - names)}; "
        f"not in the sources: {sorted(names - expected)}"
    )


def _ckptd_env(image: Image, port: int, store: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.pop("PYTHONPATH", None)
    env.update(image.env)
    # Loopback only in tests, a free port, a store of this test.
    env.update(CKPTD_HOST="127.0.0.1", CKPTD_PORT=str(port), CKPTD_STORE=str(store))
    env["PATH"] = f"{image.venv / 'bin'}:{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def served(image: Image, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, dict[str, str], Path]]:
    """The image's entrypoint and command, run from its working directory (outside
    the checkout): one server for the module's tests (each start ~2 s of CPU), which
    ask it for nothing another test here changes."""
    tmp_path = tmp_path_factory.mktemp("served")
    port = free_port()
    env = _ckptd_env(image, port, tmp_path / "store")
    cwd = image.workdir or tmp_path
    assert REPO not in cwd.parents and cwd != REPO
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (open while the server runs)
    entry = [image.bin(image.entrypoint[0]), *image.entrypoint[1:], *image.cmd]
    proc = subprocess.Popen(entry, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail(f"no answer within 60 s:\n{(tmp_path / 'serve.log').read_text()}")
        yield url, env, cwd
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


SAVE_RESTORE = """
import sys, torch, ckptd
from ckptd.client import Checkpointer
assert "{repo}" not in ckptd.__file__, ckptd.__file__
url = sys.argv[1]
ckpt = Checkpointer(url, job="wheel", rank=0, world_size=1, shm_dir=sys.argv[2])
state = {{"w": torch.arange(4096, dtype=torch.float32), "step": 7}}
ckpt.save(7, state).wait(60)
ckpt.close()
ckpt = Checkpointer(url, job="wheel", rank=0, world_size=1, shm_dir=sys.argv[2])
assert ckpt.latest() == 7
back = {{"w": torch.zeros(4096), "step": 0}}
ckpt.restore(back)
ckpt.close()
assert torch.equal(back["w"], state["w"]) and back["step"] == 7, back
print("restored", ckptd.__file__)
"""


def test_installed_wheel_serves_save_restore_verify(
    image: Image, served: tuple[str, dict[str, str], Path], tmp_path: Path
) -> None:
    url, env, cwd = served
    # The declared dependencies bring the fast HTTP stack (uvicorn[standard]).
    health = httpx.get(f"{url}/healthz", timeout=5).json()
    assert (health["http_parser"], health["event_loop"]) == ("httptools", "uvloop"), health
    shm = tmp_path / "shm"
    shm.mkdir()
    script = SAVE_RESTORE.format(repo=str(REPO))
    done = subprocess.run([image.bin("python"), "-c", script, url, str(shm)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert str(image.venv) in done.stdout
    verify = subprocess.run([image.bin("ckptd"), "verify", "wheel", "--url", url], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "ok" in verify.stdout


def test_image_health_check_passes_and_runs_as_non_root(
    image: Image, served: tuple[str, dict[str, str], Path]
) -> None:
    url, env, cwd = served
    assert image.user and image.user != "root"
    user = image.user.split(":", 1)[0]  # (USER name, uid or uid:gid)
    uid = int(user) if user.isdigit() else image.users.get(user, 0)
    assert uid != 0 and uid in image.users.values(), "the USER must be one the image creates"
    check = [image.bin(image.healthcheck[0]), *image.healthcheck[1:]]
    assert subprocess.run(check, env=env, cwd=cwd, timeout=30).returncode == 0
    # and it fails when nothing answers
    dead = {**env, "CKPTD_PORT": str(free_port())}
    assert subprocess.run(check, env=dead, cwd=cwd, timeout=30,
                          capture_output=True).returncode != 0
