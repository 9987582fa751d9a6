"""The main job with ``parallel.context_parallel_size=2`` (``run_megatron.sh``, NPROC=2, CPU/gloo): one short RL
step of ``configs/demo_cpu.yaml`` runs, the sampler and the trainer agree on the log-probs, a checkpoint is
written. The launch helpers are those of tests/job/test_main_job.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multirank import free_port

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_runs_with_cp2(tmp_path: Path) -> None:
    out_dir = tmp_path / "cp2"
    overrides = ["demo.baseline_episodes=20", "logging.progress_bar=false", "checkpoint.save_interval=1",
                 "parallel.device=cpu", "parallel.context_parallel_size=2", "demo.num_steps=1",
                 f"logging.output_dir={out_dir}"]
    env = {**os.environ, "NPROC": "2", "MASTER_PORT": str(free_port()), "PY": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *overrides], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode == 0, f"run_megatron.sh exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    for key in ("reward/mean", "policy/loss", "optim/grad_norm", "rollout/logprob_abs_diff_max"):
        assert math.isfinite(rows[0][key]), key
    assert rows[0]["rollout/logprob_abs_diff_max"] < 1e-4  # next_token_logprobs (sampler) == forward (trainer)
    assert (out_dir / "checkpoints" / "step_00000001").is_dir()
