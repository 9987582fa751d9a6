"""A user's OpenAI-client agent through the main job on the real vLLM engine: ``bash run_megatron.sh
job.agent=examples/tool_agent/agent.py:agent`` (configs/tool_agent_cpu.yaml: a tiny random Qwen3 whose chat template
renders tools, 2 ranks) trains 2 steps, every episode's calls served by the per-episode endpoint on rank 0 and
the same rollouts on both ranks. (The recording itself, trained ids == sampled ids, is tests/environments/
test_agent.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.job_run import ROOT, example_module, failure_text
from tests.support.multirank import free_port

pytestmark = [pytest.mark.engine, pytest.mark.multirank, pytest.mark.slow, pytest.mark.fleet]


def _run_agent(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    from tests.support.engine_env import engine_python

    engine_py = engine_python()
    pytest.importorskip("openai")
    model = example_module("examples/tool_agent/make_model.py").make_model(tmp_path / "model", seed=1)
    out = tmp_path / "run"
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()), "MEGATRON_RL_ENGINE_PYTHON": engine_py,
           "CONFIG": "configs/tool_agent_cpu.yaml"}
    overrides = [f"model.hf_path={model}", f"logging.output_dir={out}", "logging.progress_bar=false",
                 "job.num_steps=2", "batch.train_batch_size=2", "job.n_samples_per_prompt=2", *extra]
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure_text(proc)
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


FAULTY_AGENT = '''
import importlib.util, itertools, os, signal, time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("tool_agent", {agent!r})
tool_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool_agent)
_episodes = itertools.count()


def agent(base_url, a, b):
    n = next(_episodes)
    if n == 0:  # the run's first episode: a tool that waits on a dead service
        time.sleep(3600)
    if n == 4:  # the first episode of step 2: the only engine's API server is SIGKILLed
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "vllm_serve" in text and {out!r} in text:
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
    return tool_agent.agent(base_url, a, b)
'''


def test_a_hung_episode_and_the_lost_only_engine_cost_a_sample_and_a_wait(tmp_path):
    """One engine, job.episode_timeout_s=30: the first episode hangs (given up: a failed sample, one line naming
    its row and the limit, the step goes on); in step 2 the engine's server is SIGKILLed under an episode: its
    calls wait for the replacement, which gets the current weights and says it is back; the run finishes."""
    (tmp_path / "faulty_agent.py").write_text(FAULTY_AGENT.format(
        agent=str(ROOT / "examples" / "tool_agent" / "agent.py"), out=str(tmp_path / "run" / "engine")))
    proc, rows = _run_agent(tmp_path, f"job.agent={tmp_path / 'faulty_agent.py'}:agent", "job.episode_timeout_s=30")
    text = proc.stdout + proc.stderr
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/failed_samples"] == 1 and rows[1]["rollout/failed_samples"] == 0
    assert "episode of row" in text and "ran past job.episode_timeout_s=30 s: counted as a failed sample" in text
    assert "vLLM engine 0 is back after" in text, text[-3000:]
    assert rows[1]["rollout/engine_restarts"] >= 1 and rows[1]["rollout/engines_alive"] == 1
    assert rows[1]["rollout/logprob_abs_diff_max"] < 1e-4  # the replacement samples from the current weights


HANGING_AGENT = '''
import time
from pathlib import Path


def agent(base_url, a, b):
    Path({mark!r}).touch()
    time.sleep(3600)  # a tool that waits on a dead service
'''


def test_ctrl_c_during_a_hung_episode_ends_the_run_within_seconds(tmp_path):
    """Every episode hangs (before the first checkpoint); Ctrl-C (SIGINT to the launch's process group): the run
    ends within seconds, says that nothing was saved, and prints no traceback."""
    from tests.support.engine_env import engine_python

    import signal
    import time

    model = example_module("examples/tool_agent/make_model.py").make_model(tmp_path / "model", seed=1)
    mark = tmp_path / "hanging"
    (tmp_path / "hanging_agent.py").write_text(HANGING_AGENT.format(mark=str(mark)))
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()),
           "MEGATRON_RL_ENGINE_PYTHON": engine_python(), "CONFIG": "configs/tool_agent_cpu.yaml"}
    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), f"model.hf_path={model}",
                             f"logging.output_dir={out}", "logging.progress_bar=false", "job.num_steps=2",
                             "batch.train_batch_size=2", "job.n_samples_per_prompt=2",
                             f"job.agent={tmp_path / 'hanging_agent.py'}:agent"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.monotonic()
    text, _ = proc.communicate(timeout=120)
    assert time.monotonic() - interrupted < 30, text[-3000:]
    assert proc.returncode == 130, text[-3000:]
    assert "before the first checkpoint: nothing was saved" in text, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
