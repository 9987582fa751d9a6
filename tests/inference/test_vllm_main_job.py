"""The main job on vLLM rollouts (``configs/demo_vllm.yaml``): killed with SIGKILL mid-run it leaves no engine
process, and resumed it restarts the engine from the checkpoint's weights (the engine's log-probs of its own
samples equal the trainer's from the first resumed step on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multirank import free_port

pytestmark = [pytest.mark.engine, pytest.mark.multirank]

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # as in test_vllm_sync.py


def _launch(out: Path, engine_py: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()), "MEGATRON_RL_ENGINE_PYTHON": engine_py,
           "CONFIG": "configs/demo_vllm.yaml"}
    args = [f"logging.output_dir={out}", "logging.progress_bar=false", "demo.baseline_episodes=50",
            "checkpoint.save_interval=1", *overrides]
    return subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _engine_pids(out: Path) -> list[int]:
    """Live engine processes started for this output directory (their command line names its model folder)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "vllm_serve" in text and str(out / "engine" / "model") in text and state != "Z":
            pids.append(int(cmdline.parent.name))
    return pids


def _job_pids(out: Path) -> list[int]:
    """The main job's rank processes for this output directory."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "megatron_rl.job.main" in text and f"logging.output_dir={out}" in text:
            pids.append(int(cmdline.parent.name))
    return pids


def test_kill_then_resume_restarts_the_engine_from_the_checkpoint(engine_py, tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, engine_py, "demo.num_steps=50")
    deadline = time.monotonic() + 400
    while len(_rows(out)) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the main job did not reach step 3"
        time.sleep(0.5)
    assert _engine_pids(out), "the engine should be running"
    for pid in _job_pids(out):  # every rank (torchrun gives each its own process group), then the launcher
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while _engine_pids(out):
        assert time.monotonic() < deadline, f"engine processes {_engine_pids(out)} outlived the killed job"
        time.sleep(0.2)

    done = len(_rows(out))
    resumed = _launch(out, engine_py, f"demo.num_steps={done + 2}")
    text, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, text
    assert "resuming after step" in text
    rows = _rows(out)
    after = [row for row in rows if row["step"] > done - 1]
    assert [row["step"] for row in rows][-2:] == [done + 1, done + 2] or len(after) >= 2, rows
    for row in after:
        assert row["rollout/logprob_abs_diff_max"] <= TOLERANCE, row
        assert row["timing/weight_sync_s"] > 0
    assert not _engine_pids(out)
