"""The Python examples of docs/integrations/*.md parse and import what they use: a
reader pastes one into a program that has a model, an optimizer, a checkpointer or
a Trainer of its own, and nothing else (the float8 example used ``torch``
unimported, a NameError when pasted; ``Manager(..., ...)`` was a SyntaxError)."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations"
# What an example takes from the reader's own program, never from an import.
THEIRS = {"model", "optimizer", "ckpt", "trainer", "datamodule", "url", "state",
          "state_dict", "load_state_dict", "MyModel"}


def examples() -> list[tuple[str, str]]:
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{doc.name}:{line}", m.group(1)))
    return found


def unbound(code: str) -> set[str]:
    """The names ``code`` reads that it neither imports nor binds."""
    tree = ast.parse(code)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins)) - THEIRS


@pytest.mark.parametrize(("where", "code"), examples(), ids=[w for w, _ in examples()])
def test_an_example_imports_what_it_uses(where: str, code: str) -> None:
    assert not unbound(code), f"{where} uses, unimported: {sorted(unbound(code))}"


def test_every_integration_page_has_examples_checked() -> None:
    assert {w.split(":")[0] for w, _ in examples()} == {
        "lightning.md", "safetensors.md", "torchft.md"}
