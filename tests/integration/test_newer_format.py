"""Documents of a format version this ckptd does not know (a newer ckptd wrote
them) are ``unsupported_format`` saying to upgrade, not damage, and are never
overwritten (docs/FORMAT.md: readers MUST refuse them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.errors import UnsupportedFormat

pytestmark = pytest.mark.timeout(120)


def as_version_2(path: Path) -> bytes:
    data = path.read_bytes().replace(b'"version":1', b'"version":2')
    path.write_bytes(data)
    return data


@pytest.fixture
def newer(tmp_path: Path, shm: Path) -> Path:
    root = tmp_path / "store"
    with Checkpointer(f"file://{root}", "j", shm_dir=shm) as ckpt:
        ckpt.save(1, {"a": torch.ones(3)}).wait(60)
    as_version_2(root / "jobs/j/refs/latest")
    as_version_2(root / "jobs/j/steps/1/commit.json")
    return root


@pytest.mark.parametrize(("command", "code"), [
    (["ls"], "[unsupported_format]"), (["ls", "j"], "[unsupported_format]"),
    # the store's document, not the caller's (a 5xx over HTTP)
    (["verify", "j"], "[unsupported_stored_format]"),
])
def test_listing_and_verify_say_upgrade_not_damaged(
        newer: Path, command: list[str], code: str) -> None:
    result = CliRunner().invoke(app, [*command, "--url", f"file://{newer}"])
    assert result.exit_code != 0
    assert code in result.output and "upgrade ckptd" in result.output
    assert "damaged" not in result.output


def test_a_save_refuses_and_never_overwrites_the_newer_ref(newer: Path, shm: Path) -> None:
    ref = newer / "jobs/j/refs/latest"
    before = ref.read_bytes()
    with Checkpointer(f"file://{newer}", "j", shm_dir=shm) as ckpt, pytest.raises(
        UnsupportedFormat
    ) as err:
        ckpt.save(2, {"a": torch.zeros(3)}).wait(60)
    assert "upgrade ckptd" in str(err.value)
    assert ref.read_bytes() == before
    assert not (newer / "jobs/j/steps/2/commit.json").exists()


def test_verify_checks_the_other_steps_and_says_which_it_could_not(
        tmp_path: Path, shm: Path, server) -> None:  # noqa: ANN001
    """One step a newer ckptd committed does not stop the verify of the others: they
    are checked, and the newer one is named as not checked (not as damage), over
    file:// and through a server alike."""
    import httpx

    root = Path(server.store)
    with Checkpointer(server.url, "j", shm_dir=shm) as ckpt:
        ckpt.save(1, {"a": torch.ones(1000)}).wait(60)
        ckpt.save(2, {"a": torch.zeros(1000), "b": torch.ones(5)}).wait(60)
    server.stop()  # written while no server runs, as a newer ckptd sharing the store
    as_version_2(root / "jobs/j/steps/2/commit.json")
    server.start()

    body = httpx.post(f"{server.url}/v1/jobs/j/verify", timeout=60).json()
    assert body["steps"] == [1] and body["chunks_checked"] >= 1, body
    assert not body["bad_commits"] and not body["damage"], body
    assert len(body["unreadable"]) == 1 and "steps/2/commit.json" in body["unreadable"][0]
    assert "upgrade ckptd" in body["unreadable"][0] and body["ok"] is False

    result = CliRunner().invoke(app, ["verify", "j", "--url", f"file://{root}"])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "not checked" in said and "steps/2/commit.json" in said, said
    assert "upgrade ckptd" in said and "damaged" not in said and "Traceback" not in said
    assert "steps [1]" in said
