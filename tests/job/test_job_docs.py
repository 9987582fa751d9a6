"""docs/JOB.md lists every key of the job's sections (its table is generated from the dataclass docstrings), and
the README's and docs/JOB.md's generic commands for a step-API class and an agent work as written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_rl.job import paths
from megatron_rl.job.config import JobConfig, load_job_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_job_key_is_documented():
    text = (ROOT / "docs" / "JOB.md").read_text()
    for name in JobConfig.SECTIONS:
        section = JobConfig.__dataclass_fields__[name].default_factory()
        for f in dataclasses.fields(section):
            assert f"`{name}.{f.name}`" in text, f"docs/JOB.md does not document {name}.{f.name}"


def _generic_commands(doc: str, key: str) -> list[list[str]]:
    """The overrides of each ``bash .../run_megatron.sh ...`` command of ``doc`` that sets ``key`` (continuation
    lines joined), placeholders (``<folder>``) filled with plain names."""
    text = (ROOT / doc).read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["bash"] and len(words) > 1 and words[1].endswith("run_megatron.sh") \
                and any(w.startswith(f"{key}=") for w in words):
            commands.append([re.sub(r"<([^>]*)>", lambda m: m.group(1).replace(" ", "_"), w) for w in words[2:]])
    return commands


@pytest.mark.parametrize("key", ["job.environment", "job.agent"])
@pytest.mark.parametrize("doc", ["README.md", "docs/JOB.md"])
def test_the_generic_commands_for_a_step_api_class_and_an_agent_work_as_written(doc, key, monkeypatch, capsys):
    """What the launcher does with the command (first line, base config) and the config every rank loads: step-wise
    training with merging (and the vLLM fleet for an agent) implied and said, nothing else to set."""
    commands = _generic_commands(doc, key)
    assert commands, f"{doc} shows no generic command with {key}"
    monkeypatch.delenv("CONFIG", raising=False)
    for overrides in commands:
        assert paths.main(overrides) == 0
        first_line = capsys.readouterr().err.splitlines()[0]
        assert first_line.startswith(f"base config: {ROOT / 'configs' / 'user_job.yaml'}")
        assert "implied" in first_line and "stepwise.step_wise_trajectories=true" in first_line
        config = load_job_config(ROOT / "configs" / "user_job.yaml", overrides)
        assert config.rl.stepwise.step_wise_trajectories and config.rl.stepwise.merge_stepwise_output
        assert config.environment == "agent" if key == "job.agent" else config.environment.endswith(".py:" + (
            overrides[-1].rsplit(":", 1)[1]))
        if key == "job.agent":
            assert config.rollout.engine == "vllm" and "rollout.engine=vllm" in first_line
