"""A token's job pattern is a job name, a prefix glob (``llm-*``) or ``*``, as
docs/SECURITY.md says: ``ckptd token create`` refuses a '*' elsewhere (found by a
probe: 'a*b' was accepted). A tokens file written before that still loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.errors import InvalidRequest
from ckptd.tokens import create_token, parse_tokens


@pytest.mark.parametrize("pattern", ["a*b", "*-7b", "**", "llm-*-x*"])
def test_a_star_before_the_end_is_refused_at_creation(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(InvalidRequest, match="only at the end"):
        create_token(tmp_path / "tokens.json", pattern, "read")
    assert not (tmp_path / "tokens.json").exists()


@pytest.mark.parametrize("pattern", ["llm-7b", "llm-*", "*"])
def test_names_prefixes_and_every_job_are_taken(tmp_path: Path, pattern: str) -> None:
    _, entry = create_token(tmp_path / "tokens.json", pattern, "write")
    assert entry.job == pattern


def test_a_file_from_before_the_check_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    create_token(path, "llm-*", "read")
    doc = json.loads(path.read_text())
    doc["tokens"][0]["job"] = "a*b"
    (entry,) = parse_tokens(json.dumps(doc).encode(), str(path))
    assert entry.job == "a*b"
