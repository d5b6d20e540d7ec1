"""``ckptd import`` of a pickle (a ``pickle.dump``, or a ``torch.save`` of objects
beyond tensors) says in a line or two that the file holds pickled objects ckptd
will not unpickle, what was refused, and what to save instead; it never unpickles
them (``torch.load(weights_only=True)`` only) and imports nothing."""

from __future__ import annotations

import argparse
import fractions
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd


class _Opens:
    """Unpickled, it would create ``path``: proof that nothing was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _write(kind: str, path: Path, marker: Path) -> str:
    """Writes a pickle of ``kind``; returns what the refusal must name."""
    if kind == "pickle.dump":  # the default protocol (4 or 5): not torch.save's
        path.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
        return "protocol"
    if kind == "object":
        path.write_bytes(pickle.dumps(fractions.Fraction(1, 3), protocol=2))
        return "fractions.Fraction"
    if kind == "code":
        path.write_bytes(pickle.dumps({"w": _Opens(marker)}, protocol=2))
        return "open"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, path)
    return "argparse.Namespace"


@pytest.mark.parametrize("kind", ["pickle.dump", "object", "code", "torch.save"])
def test_a_pickle_is_refused_saying_why_and_what_to_save_instead(tmp_path: Path,
                                                                  kind: str) -> None:
    source, marker = tmp_path / "model.pkl", tmp_path / "unpickled"
    named = _write(kind, source, marker)
    store = tmp_path / "store"
    done = ckptd("import", str(source), "--job", "imp", "--step", "1",
                 "--url", f"file://{store}")
    assert_short_usage_error(done, str(source), "pickled objects", "does not unpickle",
                             "weights_only=True", named, "state_dict", "safetensors")
    said = (done.stdout + done.stderr).replace("state_dict()", "")
    assert "()" not in said and ": )" not in said, said  # (torch's text cut to nothing)
    assert "UserWarning" not in said, said  # (torch's warning about the protocol)
    assert not marker.exists()  # never unpickled
    assert not (store / "jobs" / "imp").exists()
