"""The main job with a mixture-of-experts model (``configs/demo_moe_cpu.yaml``: 4 experts, top-2, EP2 on 2 ranks).

- The pre-flight refuses an MoE layout the ranks could not build, in one line (exit code 2, no rank started):
  experts not divisible by the EP size, a world size the expert layout does not divide, EP on a dense model; and
  its checkpoint-size estimate counts every expert (the parameter count of the built model, measured).
- ``CONFIG=configs/demo_moe_cpu.yaml bash run_megatron.sh`` runs 2 RL steps at EP2, writing ``moe/*`` metrics to
  ``metrics.jsonl`` and TensorBoard and the router panel of the plot; the same command with
  ``parallel.expert_model_parallel_size=1`` resumes that checkpoint at EP1 (the optimizer's expert state
  regrouped, ``megatron_rl/checkpoint/optimizer_state.py``) and runs step 3.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multirank import free_port
from megatron_rl.job.preflight import load_job_rl_config
from megatron_rl.preflight import count_parameters
from megatron_rl.preflight import main as preflight_main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/demo_moe_cpu.yaml"
MOE_KEYS = ("moe/load_balancing_loss", "moe/z_loss")


@pytest.mark.parametrize("world_size, overrides, needle", [
    (2, ["model.num_moe_experts=3"],
     "model.num_moe_experts=3 is not divisible by parallel.expert_model_parallel_size=2"),
    (3, [], "world size 3 is not divisible by expert_tensor_parallel_size * expert_model_parallel_size"),
    (2, ["model.num_moe_experts=null", "model.moe_ffn_hidden_size=null", "model.moe_aux_loss_coeff=0",
         "model.moe_z_loss_coeff=null"], "parallel.expert_model_parallel_size=2 needs an MoE model"),
    (4, ["parallel.expert_tensor_parallel_size=2", "parallel.expert_model_parallel_size=1", "parallel.device=cpu"],
     "parallel.expert_tensor_parallel_size=2 needs CUDA"),
    (4, ["parallel.tensor_model_parallel_size=2"], "needs parallel.sequence_parallel=true"),
])  # fmt: skip
def test_preflight_refuses_an_moe_layout_in_one_line(tmp_path, capsys, world_size, overrides, needle):
    argv = ["--config", CONFIG, "--world-size", str(world_size), f"logging.output_dir={tmp_path}", *overrides]
    assert preflight_main(argv, load=load_job_rl_config) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron_rl pre-flight: config error: ") and needle in err, err
    assert len(err.splitlines()) == 1, err


def test_preflight_counts_every_expert():
    # 125,760 = sum of numel over full_state_dict() of the built demo MoE model (measured; dense demo: 76,096)
    assert count_parameters(load_job_rl_config(CONFIG, []).model) == 125_760
    assert count_parameters(load_job_rl_config("configs/demo_cpu.yaml", []).model) == 76_096


def _run_job(out_dir: Path, *overrides: str) -> str:
    """``CONFIG=configs/demo_moe_cpu.yaml bash run_megatron.sh <overrides>`` on 2 CPU ranks; returns its output."""
    env = {**os.environ, "NPROC": "2", "MASTER_PORT": str(free_port()), "PY": sys.executable, "CONFIG": CONFIG}
    args = ["demo.baseline_episodes=20", "logging.progress_bar=false", "checkpoint.save_interval=1",
            f"logging.output_dir={out_dir}", *overrides]
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode == 0, f"run_megatron.sh exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def _tensorboard_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return set(events.Tags()["scalars"])


@pytest.mark.multirank
def test_moe_demo_runs_at_ep2_and_resumes_at_ep1(tmp_path: Path) -> None:
    out_dir = tmp_path / "moe"
    out = _run_job(out_dir, "job.num_steps=2")
    assert "(TP1 PP1 DP2 EP2)" in out
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", *MOE_KEYS):
            assert math.isfinite(row[key]), (key, row)
        assert row["moe/load_balancing_loss"] > 0 and row["moe/z_loss"] > 0
        assert row["rollout/logprob_abs_diff_max"] < 1e-4  # the sampler and the trainer route alike
    assert set(MOE_KEYS) <= _tensorboard_tags(out_dir / "tensorboard")
    assert (out_dir / "reward_loss.png").is_file() and (out_dir / "checkpoints" / "step_00000002").is_dir()

    out = _run_job(out_dir, "job.num_steps=3", "parallel.expert_model_parallel_size=1")
    assert "resuming after step 2" in out and "(TP1 PP1 DP2)" in out
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(rows[2][key]) for key in MOE_KEYS)
