"""The user job explains itself (issue 31), fast checks: the base config chosen and named, paths from the
caller's directory, samples and "no learning signal" in the reports, zero-advantage groups flagged, and the
pre-flight catching data and reward mistakes before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.environments.base import Sample
from megatron_rl.environments.failures import failure
from megatron_rl.job import paths
from megatron_rl.job.config import load_job_config
from megatron_rl.job.reporting import RunReporter, WallTimes, read_metrics
from megatron_rl.trainer import zero_advantage_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_the_base_config_follows_the_task():
    assert paths.base_config(None, [])[0] == ROOT / "configs" / "demo_cpu.yaml"
    assert paths.base_config(None, ["data.train_files=p.jsonl"])[0] == ROOT / "configs" / "user_job.yaml"
    assert paths.base_config(None, ["job.environment=next_digit"])[0] == ROOT / "configs" / "demo_cpu.yaml"
    assert paths.base_config(None, ["job.agent=a.py:fn"])[0] == ROOT / "configs" / "user_job.yaml"
    assert paths.base_config("configs/demo_gpu.yaml", ["data.train_files=p.jsonl"])[0] == \
        ROOT / "configs" / "demo_gpu.yaml"  # CONFIG wins; a shipped one is found from anywhere


def test_a_users_yaml_builds_on_the_base_the_command_would_pick_unless_it_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CALLER_CWD_ENV, str(tmp_path))
    task = ["data.train_files=p.jsonl", "reward.function=r.py:f", "model.hf_path=m"]
    user_job = ROOT / "configs" / "user_job.yaml"
    (tmp_path / "my.yaml").write_text("job:\n  num_steps: 3\n")
    layers, why = paths.config_layers("my.yaml", task)
    assert layers == [user_job, tmp_path / "my.yaml"] and "data.train_files is set" in why
    config = load_job_config(layers, task)
    assert config.job.num_steps == 3 and config.rl.checkpoint.save_interval == 25  # the base's, not the default 0
    (tmp_path / "task.yaml").write_text("data:\n  train_files: p.jsonl\n")  # its own task key picks the base
    assert paths.config_layers("task.yaml", [])[0] == [user_job, tmp_path / "task.yaml"]
    (tmp_path / "alone.yaml").write_text("base: null\njob:\n  num_steps: 3\n")  # says otherwise: the defaults
    layers, _ = paths.config_layers("alone.yaml", task)
    assert layers == [tmp_path / "alone.yaml"] and load_job_config(layers, task).rl.checkpoint.save_interval == 0
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "on.yaml").write_text("base: ../my.yaml\n")  # or names its base, next to itself
    assert paths.config_layers("sub/on.yaml", task)[0] == [tmp_path / "sub" / ".." / "my.yaml", tmp_path / "sub" / "on.yaml"]
    assert paths.config_layers("configs/demo_gpu.yaml", task)[0] == [ROOT / "configs" / "demo_gpu.yaml"]  # complete


def test_the_user_job_base_fits_a_pretrained_model():
    config = load_job_config(ROOT / "configs" / "user_job.yaml",
                             ["data.train_files=p.jsonl", "reward.function=r.py:f", "model.hf_path=m"])
    assert config.rl.optimizer.lr <= 1e-5 and config.rl.algorithm.entropy_loss_coef == 0.0
    assert config.job.max_new_tokens >= 256 and config.rl.checkpoint.save_interval > 0
    assert config.rl.logging.sample_interval > 0


def test_the_launcher_names_the_base_config_first(tmp_path):
    env = {**os.environ, "CONFIG": "", "MEGATRON_RL_CALLER_CWD": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.job.paths", "data.train_files=p.jsonl"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == str(ROOT / "configs" / "user_job.yaml")
    assert proc.stderr.startswith("base config: ") and "your job: data.train_files is set" in proc.stderr
    (tmp_path / "mine.yaml").write_text("job:\n  num_steps: 3\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.job.paths"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "CONFIG": "mine.yaml"})
    demo = ROOT / "configs" / "demo_cpu.yaml"  # CONFIG from where the user stands, on the base the command picks
    assert proc.stdout.splitlines() == [str(demo), str(tmp_path / "mine.yaml")]
    assert proc.stderr.startswith(f"base config: {demo}, then {tmp_path / 'mine.yaml'} (your CONFIG on the base")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.job.paths"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "CONFIG": "nope.yaml"})
    assert proc.returncode == 2 and "CONFIG='nope.yaml' is not a file" in proc.stderr


def test_path_keys_resolve_against_the_callers_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CALLER_CWD_ENV, str(tmp_path))
    config = load_job_config(ROOT / "configs" / "user_job.yaml", [
        "model.hf_path=my_model", "data.train_files=[a.jsonl, /abs/b.jsonl]", "data.val_files=v.jsonl",
        "reward.function=rewards/r.py:score", "logging.output_dir=out"])
    assert config.rl.model.hf_path == str(tmp_path / "my_model")
    assert config.data.train_files == [str(tmp_path / "a.jsonl"), "/abs/b.jsonl"]
    assert config.data.val_files == str(tmp_path / "v.jsonl")
    assert config.reward.function == f"{tmp_path / 'rewards' / 'r.py'}:score"
    assert config.rl.logging.output_dir == str(tmp_path / "out") and config.save_dir == tmp_path / "out/checkpoints"
    module = load_job_config(ROOT / "configs" / "user_job.yaml", ["data.train_files=a.jsonl", "model.hf_path=m",
                                                                   "reward.function=my_pkg.rewards:score"])
    assert module.reward.function == "my_pkg.rewards:score"  # a module is not a path


def test_errors_name_the_users_key(tmp_path, monkeypatch):
    from megatron_rl.config import ConfigError
    from megatron_rl.environments.registry import make_environment

    monkeypatch.setenv(paths.CALLER_CWD_ENV, str(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1 plus one equals"}\n')
    config = load_job_config(ROOT / "configs" / "user_job.yaml",
                             ["model.hf_path=my_model", "data.train_files=p.jsonl", "reward.function=r.py:f"])
    with pytest.raises(ConfigError, match=f"^model.hf_path='{tmp_path / 'my_model'}' has no config.json"):
        make_environment(config)


def zero_adv(rewards, uids):
    return {k: m.final() for k, m in zero_advantage_metrics(torch.tensor(rewards), uids).items()}


def test_zero_advantage_groups_are_counted():
    assert zero_adv([1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1]) == {"rollout/zero_advantage_groups": 0.5}
    assert zero_adv([0.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]) == {"rollout/zero_advantage_groups": 1.0}
    assert zero_adv([0.0, 1.0], [0, 1]) == {}  # singletons: no group to compare within


def test_samples_are_logged_resumed_and_quoted(tmp_path, capsys):
    reporter = RunReporter(tmp_path, total_steps=4, tensorboard=True, progress_bar=False)
    for step in (1, 2, 3):
        reporter.log_step(step, {"reward/mean": 0.0, "rollout/failed_samples": 1.0})
        reporter.log_samples(step, "train", [Sample("2 plus one equals", "3", 1.0, row=7),
                                             Sample("3 plus two equals", "5", None, row=3, error="ValueError: x")])
        reporter.note_failures([failure(0, 3, ValueError("no threes"))], "reward.function")
    reporter.log_samples(3, "eval", [Sample("q", "a", 0.0)])
    reporter.close()
    out = capsys.readouterr().out
    assert out.count("reward.function failed on row 3: ValueError: no threes") == 1  # once per run, one line
    records = read_metrics(tmp_path / "samples.jsonl")
    assert len(records) == 7 and records[0] == {"step": 1, "split": "train", "row": 7, "prompt": "2 plus one equals",
                                                "response": "3", "reward": 1.0, "error": None}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert {"samples/train/text_summary", "samples/eval/text_summary"} <= set(events.Tags()["tensors"])

    resumed = RunReporter(tmp_path, total_steps=4, start_step=1, tensorboard=False, progress_bar=False)
    assert [r["step"] for r in read_metrics(tmp_path / "samples.jsonl")] == [1, 1]  # the crashed tail is gone
    resumed.log_samples(2, "train", [Sample("p", "r", 0.25)])
    summary = resumed.finish(baseline=None, times=WallTimes(1.0, 1.0, 2.0))
    assert "1 samples failed" in summary and "The last 3 samples" in summary
    assert "[step 2 train] reward 0.250" in summary and "failed: ValueError: x" in summary
    assert summary in (tmp_path / "summary.txt").read_text()


def test_preflight_finds_data_and_reward_mistakes_before_the_ranks(tmp_path):
    """python -m megatron_rl.job.preflight builds the environment: a wrong column and a missing function."""
    from tests.job.test_generic_job import make_task

    task = make_task(tmp_path)
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"question": "1 plus one equals", "target": "2"}) + "\n")
    common = [f"model.hf_path={task['model']}", f"logging.output_dir={tmp_path / 'out'}"]
    cases = [([f"data.train_files={tmp_path / 'wrong.jsonl'}", f"reward.function={task['reward']}:match"],
              "data.prompt_key='prompt': row 0 of data.train_files has no such column"),
             ([f"data.train_files={task['data']}", f"reward.function={task['reward']}:nope"],
              "has no function 'nope'")]
    for overrides, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.job.preflight", "--config",
                               str(ROOT / "configs" / "user_job.yaml"), "--world-size", "2", *common, *overrides],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
