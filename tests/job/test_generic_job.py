"""The generic main job end to end: ``bash run_megatron.sh model.hf_path=<folder> data.train_files=<file>
reward.function=<file.py:fn>`` on the default config with a model, prompts and a reward the repository does not
ship (written here); a resumed run sees exactly the prompts and metrics of the uninterrupted one; the final HF
export loads with transformers; a broken reward function stops every rank with one line before any process group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.job_run import ROOT, example_module, metric_rows, run_megatron

pytestmark = pytest.mark.multirank


def make_task(path: Path) -> dict[str, Path]:
    """A fresh tiny model, a JSONL of prompts with a `target` column, and a reward function file in ``path``."""
    example_module("examples/arithmetic/make_model.py").make_model(path / "model", seed=5)
    rows = [{"prompt": f"{a} plus one equals", "target": str((a + 1) % 10)} for a in range(10)]
    (path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "my_reward.py").write_text(
        "def match(prompt, response, target):\n"
        "    return {'reward': float(response.split()[:1] == [target]), 'length': len(response.split())}\n")
    return {"model": path / "model", "data": path / "prompts.jsonl", "reward": path / "my_reward.py"}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return make_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def after_two_steps(task, tmp_path_factory) -> Path:
    """A run stopped after 2 steps (checkpoint at step 2): copied by the tests that go on from there."""
    out = tmp_path_factory.mktemp("generic") / "two"
    run(task, out, "job.num_steps=2")
    return out


def copy_of(run_dir: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, dest)
    return dest


def run(task: dict[str, Path], out_dir: Path, *extra: str) -> str:
    return run_megatron(*overrides(task, out_dir, task["reward"]), *extra).stdout


def overrides(task: dict[str, Path], out_dir: Path, reward: Path) -> list[str]:
    return [f"model.hf_path={task['model']}", f"data.train_files={task['data']}", f"reward.function={reward}:match",
            f"logging.output_dir={out_dir}", "logging.progress_bar=false", "checkpoint.save_interval=2",
            "batch.train_batch_size=4"]


def test_generic_job_runs_logs_exports_and_resumes_exactly(task, after_two_steps, tmp_path):
    straight = tmp_path / "straight"
    out = run(task, straight, "job.num_steps=4")
    assert "single_turn: train: 10 prompts" in out
    full = metric_rows(straight)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all("reward_fn/length" in r and r["data/epoch"] >= 0 for r in full)
    assert (straight / "reward_loss.png").is_file() and (straight / "summary.txt").is_file()

    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(straight / "hf" / "step_4", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    changed = [n for n, p in exported.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert changed, "the export holds the trained weights, not the initial ones"

    resumed = copy_of(after_two_steps, tmp_path / "resumed")
    out = run(task, resumed, "job.num_steps=4")
    assert "resuming after step 2" in out
    assert metric_rows(resumed) == full  # same prompts (data position restored), same samples, same updates


def test_broken_reward_stops_before_any_process_group(task, monkeypatch, capsys, tmp_path):
    from megatron_rl.job.main import main

    (tmp_path / "bad.py").write_text("def match(prompt, response):\n    return 1.0\n")
    monkeypatch.setenv("RANK", "0")
    code = main(["--config", str(ROOT / "configs" / "demo_cpu.yaml"), f"model.hf_path={task['model']}",
                 f"data.train_files={task['data']}", f"reward.function={tmp_path / 'bad.py'}:match"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: reward.function=" in err and "raised TypeError" in err, err
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_readme_command_from_another_directory_with_relative_paths_and_a_failing_row(task, tmp_path):
    """The README's generic command as written, run from the user's directory with relative paths, on the
    user-job base config; the reward function raises on one row: the run goes on, says so once, counts it."""
    import shutil

    shutil.copytree(task["model"], tmp_path / "model")
    shutil.copy(task["data"], tmp_path / "prompts.jsonl")
    (tmp_path / "my_reward.py").write_text(
        "def match(prompt, response, target):\n"
        "    if prompt.startswith('3 '):\n"
        "        raise KeyError('no rule for 3')\n"
        "    return float(response.split()[:1] == [target])\n")
    proc = run_megatron("model.hf_path=model", "data.train_files=prompts.jsonl", "reward.function=my_reward.py:match",
                        "job.num_steps=2", "batch.train_batch_size=10", "batch.policy_mini_batch_size=5",
                        "job.n_samples_per_prompt=2", "job.max_new_tokens=4", "logging.progress_bar=false",
                        "logging.sample_interval=1", "data.shuffle=false", config="", cwd=tmp_path)
    assert proc.stderr.startswith(f"base config: {ROOT / 'configs' / 'user_job.yaml'}")
    out_dir = tmp_path / "outputs" / "user_job"  # logging.output_dir of the base, from the user's directory
    assert "reward.function failed on row 3: KeyError: 'no rule for 3'" in proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).count("failed on row") == 1
    metrics = metric_rows(out_dir)
    assert [m["rollout/failed_samples"] for m in metrics] == [2.0, 2.0]  # row 3's two samples, every step
    assert all(m["rollout/dropped_groups"] == 1.0 and "rollout/zero_advantage_groups" in m for m in metrics)
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2} and any(s["error"] for s in samples)
    assert "The last 3 samples" in (out_dir / "summary.txt").read_text()
    import yaml

    written = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert written["model"]["hf_path"] == str(tmp_path / "model")  # absolute in the written config


def test_a_step_where_every_sample_fails_stops_with_one_line_and_keeps_the_checkpoint(task, after_two_steps,
                                                                                      tmp_path):
    """Two good steps (a checkpoint at step 2), then a reward function that raises on every response (it passes
    the start-up check, which calls it with response=''): the resumed run stops at step 3 with one line."""
    out_dir = copy_of(after_two_steps, tmp_path / "run")
    broken = tmp_path / "broken.py"
    broken.write_text("def match(prompt, response, target):\n"
                      "    if response:\n"
                      "        raise RuntimeError('scorer offline')\n"
                      "    return 0.0\n")
    proc = run_megatron(*overrides(task, out_dir, broken), "job.num_steps=4", code=2)
    lines = [line for line in proc.stderr.splitlines() if "rollout error" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "samples of the step failed" in lines[0] and "RuntimeError: scorer offline" in lines[0]
    assert f"the last complete checkpoint in {out_dir / 'checkpoints'} is kept" in lines[0]
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step_*")) == ["step_00000002"]


def test_a_failed_batch_generated_ahead_saves_the_steps_trained_before_it(task, after_two_steps, tmp_path):
    """One step off (``rollout.max_staleness=1``) from the checkpoint of step 2, no checkpoint due before step 10;
    the reward function fails on every response of the third batch this run generates (step 5's, generated while
    step 4 trains): the run trains steps 3 and 4, saves them, then stops at step 5 with one line (before, steps 3
    and 4 were lost); the same command with a working reward resumes after step 4, with no step twice."""
    out_dir = copy_of(after_two_steps, tmp_path / "run")
    rows = 4 * 8  # batch.train_batch_size x job.n_samples_per_prompt (configs/user_job.yaml, the base config here)
    flaky = tmp_path / "flaky.py"
    flaky.write_text(f"calls = 0\n\n"
                     "def match(prompt, response, target):\n"
                     "    global calls\n"
                     "    calls += 1  # the start-up check is call 1\n"
                     f"    if calls > 1 + 2 * {rows}:\n"
                     "        raise RuntimeError('scorer offline')\n"
                     "    return float(response.split()[:1] == [target])\n")
    async_run = ("rollout.max_staleness=1", "checkpoint.save_interval=10", "checkpoint.keep_last=5")
    proc = run_megatron(*overrides(task, out_dir, flaky), *async_run, "job.num_steps=6", code=2)
    assert "the rollouts of step 5 failed; saved the steps trained before it (checkpoint of step 4)" in proc.stdout
    assert "samples of the step failed" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in metric_rows(out_dir)] == [1, 2, 3, 4]

    assert "resuming after step 4" in run(task, out_dir, *async_run, "job.num_steps=6")
    assert [r["step"] for r in metric_rows(out_dir)] == [1, 2, 3, 4, 5, 6]

