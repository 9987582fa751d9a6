"""Smoke tests: every script in examples/ runs as written (subprocess, CPU), and its printed numbers hold.

Each script makes its own tiny random Qwen3 (examples/common.py). References: transformers' forward on the
same rows (fp32: summation order only, measured 2.4e-7 -> tolerance 1e-4) and the one-process step for TP2
(same weights and rollouts: the metrics agree to fp32 rounding; measured equal to 6 digits).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.job_run import example_module

pytestmark = pytest.mark.slow  # each test runs an example script in a subprocess

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


def run_example(script: str, *args: str, torchrun: int = 0) -> str:
    """stdout + stderr of ``python [-m torch.distributed.run ...] <ROOT>/<script> <args>`` run from a scratch folder
    (a user's working directory is not the repository: every relative path the example hands on must hold)."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun)] if torchrun else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.pop("MEGATRON_RL_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="megatron_rl_example_cwd_") as scratch:
        done = subprocess.run([sys.executable, *launcher, str(ROOT / script), *args], cwd=scratch, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def numbers_after(text: str, label: str) -> float:
    match = re.search(re.escape(label) + r"\s*([-+0-9.e]+)", text)
    assert match, f"{label!r} not in output:\n{text}"
    return float(match.group(1))


def step_metrics(output: str) -> dict[str, float]:
    line = next(line for line in output.splitlines() if line.startswith("tp="))
    return {k: float(v) for k, v in re.findall(r"(\S+)=([-+0-9.e]+|nan)", line.split(":", 1)[1])}


@pytest.fixture(scope="module")
def one_process_step() -> str:
    return run_example("examples/grpo_step.py")


def test_grpo_step(one_process_step):
    metrics = step_metrics(one_process_step)
    assert metrics["reward/mean"] == 0.5 and metrics["optim/lr"] == pytest.approx(1e-4)
    assert metrics["optim/grad_norm"] > 0
    # quiet by default: at most one line about megatron-core/mbridge fallbacks, the HF values in one line
    assert "Falling back" not in one_process_step and "full scope" not in one_process_step
    assert one_process_step.count("megatron_rl.hf:") == 1


@pytest.mark.multirank
def test_grpo_step_tp2_equals_one_process(one_process_step):
    output = run_example("examples/grpo_step.py", "--tp", "2", torchrun=2)
    assert "tp=2 dp=1" in output
    ours, reference = step_metrics(output), step_metrics(one_process_step)
    for name, value in reference.items():
        assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def test_logprobs_vs_hf():
    output = run_example("examples/logprobs_vs_hf.py")
    assert numbers_after(output, "response tokens") < TOL
    assert numbers_after(output, "(prompt tokens too)") < TOL


def test_export_hf():
    output = run_example("examples/export_hf.py")
    assert numbers_after(output, "max |weight change| from the source") > 0  # the step moved the weights
    assert numbers_after(output, "max |logprob diff| vs the policy") < TOL


def test_readme_library_use_runs_as_written(tmp_path):
    """The README's "Library use" snippet, with only its ``hf_dir = ...`` line pointed at a tiny Qwen3."""
    tiny_qwen3 = example_module("examples/common.py").tiny_qwen3
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Library use"):]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start:section.index("\n```", start)]
    hf_line = next(line for line in snippet.splitlines() if line.startswith("hf_dir = "))
    hf_dir = tiny_qwen3(tmp_path / "qwen3")
    script = tmp_path / "readme_snippet.py"
    script.write_text(snippet.replace(hf_line, f"hf_dir = {str(hf_dir)!r}") + "\nprint('OK', metrics['policy/loss'])\n")
    output = run_example(str(script))
    assert "\nOK " in output


@pytest.mark.engine
def test_grpo_vllm_engine_follows_the_trainer():
    from tests.support.engine_env import engine_python

    os.environ.setdefault("MEGATRON_RL_ENGINE_PYTHON", engine_python())
    output = run_example("examples/grpo_vllm.py")
    diffs = [float(d) for d in re.findall(r"logprob max \|diff\| ([-+0-9.e]+)", output)]
    assert len(diffs) == 8 and max(diffs) <= TOL, output  # the engine samples from the trainer's weights every step
