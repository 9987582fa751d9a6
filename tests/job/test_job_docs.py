"""docs/JOB.md lists every key of the job's sections (its table is generated from the dataclass docstrings)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.job.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_job_key_is_documented():
    text = (ROOT / "docs" / "JOB.md").read_text()
    for name in JobConfig.SECTIONS:
        section = JobConfig.__dataclass_fields__[name].default_factory()
        for f in dataclasses.fields(section):
            assert f"`{name}.{f.name}`" in text, f"docs/JOB.md does not document {name}.{f.name}"
