"""docs/multinode.md gives the commands the multi-node tests run, word for word:
the replica's ``ckptd serve`` and the one ``torchrun`` command every node runs,
with its environment (constants only)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from tests.multinode.hosts import Host
from tests.multinode.jobs import LAUNCH_ENV, WORKER, Job, Replica

DOC = Path(__file__).resolve().parents[2] / "docs" / "multinode.md"
URLS = ["http://ckptd-a:8470", "http://ckptd-b:8470"]


def commands() -> list[list[str]]:
    """The doc's shell commands, in order, split as a shell would."""
    return [shlex.split(block.replace("\\\n", " "))
            for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)]


def test_the_replica_command_is_the_one_the_tests_run() -> None:
    host = cast(Host, SimpleNamespace(name="ckptd-a"))
    replica = Replica(host, Path("/shared/ckptd-store"), URLS)
    ran, doc = replica.command(), commands()[0]
    env = dict(word.split("=", 1) for word in doc[:doc.index("ckptd")])
    assert env == {"CKPTD_PEER_SECRET": "$PEER_SECRET"}  # (the tests': one for all)
    assert set(env) <= set(replica.env())
    assert [Path(ran[0]).name, *ran[1:]] == doc[doc.index("ckptd"):]


def test_every_node_runs_the_command_the_tests_run(tmp_path: Path) -> None:
    doc = commands()[1]
    env = dict(word.split("=", 1) for word in doc[:doc.index("torchrun")])
    assert env == {**LAUNCH_ENV, "CKPTD_URL": ",".join(URLS)}
    ran = Job("llm-7b", tmp_path, URLS).command()
    worker = ran.index(str(WORKER))
    assert [Path(ran[0]).name, *ran[1:worker], "train.py"] == doc[doc.index("torchrun"):]
    assert Job("llm-7b", tmp_path, URLS).env()["CKPTD_URL"] == env["CKPTD_URL"]


def test_the_readme_gives_the_same_node_command() -> None:
    readme = (DOC.parents[1] / "README.md").read_text()
    several = readme.split("## Several nodes", 1)[1].split("\n## ", 1)[0]
    blocks = [shlex.split(b) for b in re.findall(r"```bash\n(.*?)```", several, re.S)]
    assert blocks == [commands()[1]]
