"""One config object for a Checkpointer (``CheckpointerConfig``): the keyword
arguments build it, ``from_config`` takes it, and it refuses what the
constructor refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.config import CheckpointerConfig
from ckptd.errors import InvalidRequest


def test_the_keyword_constructor_builds_the_config(tmp_path: Path, shm: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_ON_ERROR", "warn")
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "cfg", rank=1, world_size=2, shm_dir=shm, chunk_size=8192,
                      on_busy="skip", timeout=5.0) as ckpt:
        cfg = ckpt.config
        assert cfg == CheckpointerConfig(url, "cfg", 1, 2, None, chunk_size=8192,
                                         on_busy="skip", on_error="warn", timeout=5.0,
                                         shm_dir=shm)
        assert (ckpt.job, ckpt.rank, ckpt.chunk_size, ckpt.on_error) == ("cfg", 1, 8192, "warn")
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.job = "other"  # type: ignore[misc]


def test_from_config_saves_and_restores(tmp_path: Path, shm: Path) -> None:
    cfg = CheckpointerConfig.of(f"file://{tmp_path / 'store'}", "cfg", shm_dir=shm)
    state = {"w": torch.arange(10.0), "n": 3}
    with Checkpointer.from_config(cfg) as ckpt:
        assert ckpt.save(1, state).wait(timeout=30).state == "committed"
        target: dict[str, object] = {}
        assert ckpt.restore(target).step == 1
        assert torch.equal(target["w"], state["w"]) and target["n"] == 3  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"chunk_size": 100},
        {"on_busy": "queue"},
        {"on_error": "ignore"},
        {"default_placement": "sharded"},
        {"staging_budget": 4096},
        {"rank": 2},
        {"job": "no/slash"},
    ],
)
def test_a_bad_setting_is_refused_by_the_config(tmp_path: Path, changes: dict[str, object]
                                                ) -> None:
    cfg = CheckpointerConfig.of(f"file://{tmp_path}", "cfg", rank=0, world_size=2)
    with pytest.raises(InvalidRequest):
        cfg.replace(**changes)


def test_a_health_policy_file_that_cannot_be_read_is_refused_at_construction(
    tmp_path: Path, shm: Path
) -> None:
    """(found by a probe: it was refused only at the first step())"""
    url = f"file://{tmp_path / 'store'}"
    directory = tmp_path / "a-directory.toml"
    directory.mkdir()
    for bad in (tmp_path / "missing.toml", directory):
        with pytest.raises(InvalidRequest) as caught:
            Checkpointer(url, "cfg", shm_dir=shm, health_policy=bad)
        said = str(caught.value)
        assert str(bad) in said and "health_policy" in said and "\n" not in said, said
    broken = tmp_path / "broken.toml"
    broken.write_text("[thresholds\n")
    with pytest.raises(InvalidRequest, match="broken.toml"):
        Checkpointer(url, "cfg", shm_dir=shm, health_policy=str(broken))
    good = tmp_path / "good.toml"
    good.write_text("")
    with Checkpointer(url, "cfg", shm_dir=shm, health_policy=good) as ckpt:
        assert ckpt.config.health_policy == good


@pytest.mark.parametrize("raw", ["99999", "-1", "http"])
def test_a_bad_peer_port_from_the_environment_is_refused_at_construction(
    raw: str, tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``peer_port=99999`` is: it was read only where the peer server started
    (a file:// store's checkpointer, which starts none, never said)."""
    monkeypatch.setenv("CKPTD_PEER_PORT", raw)
    with pytest.raises(InvalidRequest, match=f"CKPTD_PEER_PORT='{raw}'.*0 to 65535"):
        Checkpointer(f"file://{tmp_path / 'store'}", "cfg", shm_dir=shm)
    with pytest.raises(InvalidRequest, match="CKPTD_PEER_PORT"):
        CheckpointerConfig.of(f"file://{tmp_path / 'store'}", "cfg")
    # An argument wins over the environment, as for every knob.
    with Checkpointer(f"file://{tmp_path / 'store'}", "cfg", shm_dir=shm, peer_port=0):
        pass


@pytest.mark.parametrize(("name", "value"), [
    ("CKPTD_ON_ERROR", "warning"), ("CKPTD_ON_ERROR", "maybe"),
    ("CKPTD_DIRECT_READS", "of"), ("CKPTD_DIRECT_WRITES", "nope"),
    ("CKPTD_RESTORE_HUGE_PAGES", "sure"), ("CKPTD_H2D_SCRATCH", "2"),
])
def test_a_mistyped_word_in_the_environment_is_refused_not_taken_for_the_default(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: CKPTD_ON_ERROR=warning was taken for 'raise' (a failed save
    then stopped training it was meant to warn about), and an on/off setting took any
    word it did not know for its default (CKPTD_DIRECT_READS=off stayed on)."""
    from ckptd import knobs

    read = {"CKPTD_ON_ERROR": knobs.on_error, "CKPTD_DIRECT_READS": knobs.direct_reads,
            "CKPTD_DIRECT_WRITES": knobs.direct_writes,
            "CKPTD_RESTORE_HUGE_PAGES": knobs.restore_huge_pages,
            "CKPTD_H2D_SCRATCH": knobs.h2d_scratch}[name]
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidRequest, match=f"{name}='{value}' is not one of"):
        read()
    if name == "CKPTD_ON_ERROR":
        with pytest.raises(InvalidRequest, match="raise, warn"):
            CheckpointerConfig.of("file:///nowhere", "j")
    monkeypatch.setenv(name, {"CKPTD_ON_ERROR": "WARN", "CKPTD_H2D_SCRATCH": "Auto"}.get(
        name, "off"))
    assert read() in ("warn", "auto", False)
