"""Asynchronous RL through the main job (``rollout.max_staleness``, ``job/pipeline.py``): the schedule (staleness
0 at step 1, then K), the batches generated ahead kept in the checkpoint so that a resumed run (after a clean
stop or a SIGKILL at any instant) continues bitwise as the uninterrupted one, and on the vLLM fleet with two
ranks (the rollout thread's own process group) the same, the engines generating while the trainer trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support.job_run import ROOT, failure_text, metric_rows, run_megatron
from tests.support.multirank import free_port

CONFIG = ROOT / "configs" / "demo_cpu.yaml"
pytestmark = pytest.mark.multirank


def overrides(out_dir: Path, *extra: str) -> list[str]:
    return [f"logging.output_dir={out_dir}", "logging.progress_bar=false", "demo.baseline_episodes=50",
            "batch.train_batch_size=8", "checkpoint.save_interval=2", *extra]


def run(out_dir: Path, *extra: str) -> str:
    return run_megatron(*overrides(out_dir, *extra), config=CONFIG).stdout


def staleness(rows: list[dict]) -> list[float]:
    return [r["rollout/staleness_max"] for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """The uninterrupted one-step-off run both resume tests compare with: 6 steps, a checkpoint after each (all
    kept). The LR schedule is constant after warm-up, so its first 4 rows are those of a 4-step run."""
    out = tmp_path_factory.mktemp("async") / "straight"
    run(out, "job.num_steps=6", "rollout.max_staleness=1", "checkpoint.save_interval=1", "checkpoint.keep_last=6")
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["rollouts_ahead"]["steps"] == [3]  # generated during step 2 on the weights of step 1
    return metric_rows(out)


def test_one_step_off_schedule_checkpoint_and_exact_resume(straight, tmp_path):
    full = straight[:4]
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert staleness(full) == [0, 1, 1, 1] and [r["rollout/staleness_mean"] for r in full] == [0, 1, 1, 1]

    resumed, dropped = tmp_path / "resumed", tmp_path / "dropped"
    run(resumed, "job.num_steps=2", "rollout.max_staleness=1")
    shutil.copytree(resumed, dropped)
    assert "resuming after step 2" in run(resumed, "job.num_steps=4", "rollout.max_staleness=1")
    assert metric_rows(resumed) == full  # the batch of step 3 came from the checkpoint, not from new weights

    # without it, step 3 would be sampled again (on newer weights, from later prompts): a different run
    path = dropped / "checkpoints" / "step_00000002" / "trainer_state.json"
    state = json.loads(path.read_text())
    del state["rollouts_ahead"]
    _rewrite_verified(path, state)
    run(dropped, "job.num_steps=4", "rollout.max_staleness=1")
    assert metric_rows(dropped)[2] != full[2]


def _rewrite_verified(path: Path, state: dict) -> None:
    """Edit a checkpoint's trainer state and its digest in the manifest (a planted bug, not a damaged file)."""
    from megatron_rl.checkpoint import layout

    path.write_text(json.dumps(state, indent=1, sort_keys=True))
    manifest_path = path.parent / layout.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name] = layout.file_record(path)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_two_steps_ahead_and_a_resume_with_another_bound_loses_no_batch(tmp_path):
    out = tmp_path / "k2"
    run(out, "job.num_steps=4", "rollout.max_staleness=2")
    rows = metric_rows(out)
    assert staleness(rows) == [0, 1, 2, 2]
    # resumed with K=0 from the checkpoint of step 2 (which holds the batches of steps 3 and 4): both are trained
    # first, as generated, then the loop generates on the newest weights again
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    shutil.rmtree(changed / "checkpoints" / "step_00000004")
    (changed / "checkpoints" / "latest").write_text("step_00000002")
    run(changed, "job.num_steps=5", "rollout.max_staleness=0")
    again = metric_rows(changed)
    assert again[:4] == rows and staleness(again) == [0, 1, 2, 2, 0]


def test_sigkill_at_any_instant_then_the_same_command_resumes_bitwise(straight, tmp_path):
    """One run directory, its job SIGKILLed three times, each time after a later checkpoint appeared and a different
    delay (in generation, training, saving: timing-dependent), each kill followed by the same command, the last
    one left to finish: the rows of the uninterrupted run (each resume continues from what the previous kill
    left, so one launch per kill instead of two)."""
    out = tmp_path / "killed"
    args = overrides(out, "job.num_steps=6", "rollout.max_staleness=1", "checkpoint.save_interval=1")
    for delay in (0.0, 0.35, 0.7):
        saved = [int(p.name[5:]) for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
        checkpoint = max([1, *saved]) + 1  # the 2nd checkpoint first (one batch generated ahead), then the next one
        env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()), "CONFIG": str(CONFIG)}
        proc = subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 200
        while not (out / "checkpoints" / f"step_{checkpoint:08d}").exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"the run did not reach checkpoint {checkpoint}"
            time.sleep(0.05)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    run(out, "job.num_steps=6", "rollout.max_staleness=1", "checkpoint.save_interval=1")
    assert metric_rows(out) == straight


@pytest.mark.engine
@pytest.mark.fleet
def test_one_step_off_on_a_fleet_of_two_with_two_ranks_resumes_bitwise_after_a_sigkill(tmp_path):
    """Two engines generate the next batch while both ranks train (the rollout thread broadcasts over its own
    group); a SIGKILL of the whole job after the checkpoint of step 2, then the same command: the rows of the
    uninterrupted run."""
    from tests.support.engine_env import engine_python

    vllm = ROOT / "configs" / "demo_vllm.yaml"
    env = {**os.environ, "PY": sys.executable, "NPROC": "2", "CONFIG": str(vllm),
           "MEGATRON_RL_ENGINE_PYTHON": engine_python()}

    def command(out: Path) -> tuple[list[str], dict]:
        args = [f"logging.output_dir={out}", "job.num_steps=4", "rollout.max_staleness=1", "rollout.num_engines=2",
                "logging.progress_bar=false", "checkpoint.save_interval=2", "demo.baseline_episodes=50"]
        return ["bash", str(ROOT / "run_megatron.sh"), *args], {**env, "MASTER_PORT": str(free_port())}

    def finish(out: Path) -> None:
        args, env_ = command(out)
        proc = subprocess.run(args, cwd=ROOT, env=env_, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, failure_text(proc)

    finish(tmp_path / "straight")
    full = metric_rows(tmp_path / "straight")
    assert staleness(full) == [0, 1, 1, 1] and all(r["rollout/engines_alive"] == 2 for r in full)
    assert full[0]["rollout/logprob_abs_diff_max"] <= 1e-4  # step 1: on-policy, the engines have the weights

    killed = tmp_path / "killed"
    args, env_ = command(killed)
    proc = subprocess.Popen(args, cwd=ROOT, env=env_, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 400
    while not (killed / "checkpoints" / "step_00000002").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # engines die with their watchdog on rank 0
    proc.wait()
    finish(killed)
    assert metric_rows(killed) == full


@pytest.mark.engine
@pytest.mark.fleet
def test_partial_rollouts_count_staleness_per_token_and_a_kill_loses_no_batch(tmp_path):
    """Partial rollouts (timing-dependent): staleness per token within [0, K]; a SIGKILL during the weight sync
    after step 4 (the engines paused, requests in flight: ``inference/vllm/sync.py: STALL_ENV``): the checkpoint of step 3
    holds the batch generated ahead, and the resumed run trains exactly that batch next (its rewards), then goes on
    to the last step: no step's batch lost or generated twice."""
    import base64
    import pickle
    import statistics

    from tests.support.engine_env import engine_python

    out = tmp_path / "partial"
    args = [f"logging.output_dir={out}", "logging.progress_bar=false", "demo.baseline_episodes=50", "job.num_steps=6",
            "checkpoint.save_interval=3", "rollout.max_staleness=1", "rollout.partial_rollouts=true"]
    env = {**os.environ, "PY": sys.executable, "MEGATRON_RL_ENGINE_PYTHON": engine_python(), "NPROC": "1",
           "CONFIG": str(ROOT / "configs" / "demo_vllm.yaml")}
    from megatron_rl.inference.vllm.sync import STALL_ENV

    stalled = tmp_path / "stalled"
    proc = subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT,
                            env={**env, "MASTER_PORT": str(free_port()), STALL_ENV: f"4:{stalled}"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 400
    while not stalled.exists():  # rank 0 inside the 4th sync, the engines paused
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its 4th sync"
        time.sleep(0.05)
    # every rank (torchrun gives each its own process group) and the launcher; the engines die with their watchdog
    subprocess.run(["pkill", "-9", "-f", f"logging.output_dir={out}"], check=False)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "step_00000004").exists()
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    ((step, _, ahead, _, token_steps),) = pickle.loads(base64.b64decode(state["rollouts_ahead"]["batches"]))
    assert step == 4 and sum(token_steps.values()) > 0 and set(token_steps) <= {2, 3}
    done = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT,
                          env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, failure_text(done)
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    out_ = ahead.output  # the trainer's reward/mean: the summed rewards of each trajectory's last step
    rewards = [sum(r) if isinstance(r, list) else r for r, last in zip(out_["rewards"], out_["is_last_step"]) if last]
    assert rows[3]["reward/mean"] == pytest.approx(statistics.fmean(rewards), rel=1e-5)
    for r in rows:
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 1
    assert rows[0]["rollout/staleness_max"] == 0 and rows[3]["rollout/staleness_max"] == 1
