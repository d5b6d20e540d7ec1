"""A retention file's section for a job name no store can hold is refused in one
line naming the section (an operator's probe: `[retention.jobs."bad name!"]` was
accepted, and its rules applied to no job)."""

from __future__ import annotations

import pytest

from ckptd.errors import InvalidPolicy
from ckptd.lifecycle.retention import parse_retention


def test_a_retention_section_for_an_impossible_job_name_is_refused() -> None:
    """Before: accepted silently, and its rules applied to no job."""
    text = ('[retention]\nkeep_last = 5\n\n[retention.jobs."bad name!"]\nkeep_last = 1\n')
    with pytest.raises(InvalidPolicy) as refused:
        parse_retention(text, "retention.toml")
    said = refused.value.message
    assert said.startswith('retention.toml: [retention.jobs."bad name!"] names no job')
    assert "\n" not in said
    assert parse_retention(text.replace("bad name!", "good.name-1"), "r.toml").jobs
