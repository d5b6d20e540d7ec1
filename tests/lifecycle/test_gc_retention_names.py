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


def test_a_misnamed_jobs_table_is_said_with_the_table_meant() -> None:
    """(An operator's probe: ``[retention.job.llm-7b]`` got "unknown keys ['job']
    (known: keep_last, ...)", which never named [retention.jobs.<job>].)"""
    text = "[retention]\nkeep_last = 2\n\n[retention.job.llm-7b]\nkeep_last = 1\n"
    with pytest.raises(InvalidPolicy) as refused:
        parse_retention(text, "retention.toml")
    said = refused.value.message
    assert "unknown keys ['job']" in said and "[retention.jobs.<job>]" in said, said
    assert said.endswith("did you mean [retention.jobs.llm-7b]?"), said
    # A job's own table holds rules only: no jobs named there.
    with pytest.raises(InvalidPolicy) as refused:
        parse_retention("[retention.jobs.a]\nkeep_lst = 1\n", "retention.toml")
    assert "jobs" not in refused.value.message.split("(known:")[1], refused.value.message
