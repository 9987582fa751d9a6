"""A user's OpenAI-client agent through the main job on the real vLLM engine: ``bash run_megatron.sh
job.agent=examples/tool_agent/agent.py:agent`` (configs/tool_agent_cpu.yaml: a tiny random Qwen3 whose chat template
renders tools, 2 ranks) trains 2 steps, every episode's calls served by the per-episode endpoint on rank 0 and
the same rollouts on both ranks. (The recording itself, trained ids == sampled ids, is tests/environments/
test_agent.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multirank import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.engine, pytest.mark.multirank, pytest.mark.slow, pytest.mark.fleet]


def _run_agent(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    from engine_env import engine_python

    engine_py = engine_python()
    pytest.importorskip("openai")
    spec = importlib.util.spec_from_file_location("tool_agent_make_model",
                                                  ROOT / "examples" / "tool_agent" / "make_model.py")
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    model = make_model.make_model(tmp_path / "model", seed=1)
    out = tmp_path / "run"
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()), "MEGATRON_RL_ENGINE_PYTHON": engine_py,
           "CONFIG": "configs/tool_agent_cpu.yaml"}
    overrides = [f"model.hf_path={model}", f"logging.output_dir={out}", "logging.progress_bar=false",
                 "job.num_steps=2", "batch.train_batch_size=2", "job.n_samples_per_prompt=2", *extra]
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_tool_agent_example_trains_on_the_vllm_fleet(tmp_path):
    proc, rows = _run_agent(tmp_path)
    assert "agent agent (" in proc.stdout and "examples/tool_agent/agent.py:agent)" in proc.stdout
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/failed_samples"] == 0 and r["episode/calls_mean"] >= 2  # at least: a reply and a nudge
        assert r["rollout/logprob_abs_diff_max"] < 1e-4  # the endpoint samples what the trainer scores
        assert "episode/new_steps_mean" in r and "stepwise/num_seq_after_merge" in r
        assert "episode/mixed_versions" not in r  # (partial rollouts only)


def test_the_agent_one_step_off_with_partial_rollouts_counts_its_tokens_versions(tmp_path):
    """An agent's calls under partial rollouts go through /inference/v1/generate: every trained token carries its
    weight version, so the staleness is per token and the step says how many episodes spanned a sync."""
    _, rows = _run_agent(tmp_path, "rollout.max_staleness=1", "rollout.partial_rollouts=true", "job.num_steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/failed_samples"] == 0 and 0.0 <= r["episode/mixed_versions"] <= 1.0
    assert rows[0]["rollout/staleness_max"] == 0.0  # step 1: the initial weights, the ones it trains
    for r in rows[1:]:  # later steps: sampled while the previous step trained, at most one version behind
        assert 0.0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 1.0
