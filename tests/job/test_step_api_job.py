"""A user's step-API environment through the main job: ``bash run_megatron.sh job.environment=<file.py>:<Class>``
with the digit game of examples/digit_game on a tiny random Qwen3 (built-in engine, 2 ranks): it trains, logs the
per-turn metrics, evaluates, exports, and a resumed run replays the uninterrupted one; a broken class stops every
rank with one line before any process group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.support.job_run import ROOT, example_module, metric_rows, run_megatron

CONFIG = ROOT / "configs" / "digit_game_cpu.yaml"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return example_module("examples/digit_game/make_model.py").make_model(tmp_path_factory.mktemp("digit") / "model", seed=3)


def run(model: Path, out_dir: Path, *extra: str) -> str:
    overrides = [f"model.hf_path={model}", f"logging.output_dir={out_dir}", "logging.progress_bar=false",
                 "checkpoint.save_interval=1", "batch.train_batch_size=4", "eval.interval=2", "eval.num_prompts=4",
                 "optimizer.lr_warmup_steps=0",  # the 1-step run below has 4 optimizer steps in all
                 *extra]
    return run_megatron(*overrides, config=CONFIG).stdout


def test_the_digit_game_class_trains_through_the_main_job_and_resumes_exactly(model, tmp_path):
    straight = tmp_path / "straight"
    out = run(model, straight, "job.num_steps=2")
    assert f"step-API environment DigitGame ({ROOT / 'examples/digit_game/env.py'}:DigitGame)" in out
    full = metric_rows(straight)
    assert [r["step"] for r in full] == [1, 2]
    for r in full:
        assert r["episode/turns_mean"] == 3 and r["episode/ended_done"] == 4 * 8 and r["rollout/failed_samples"] == 0
        assert r["stepwise/num_seq_after_merge"] == 4 * 8  # raw text extends: one sequence per episode
        assert "episode/turn_3/reward_mean" in r
    assert "eval/reward_mean" in full[-1] and (straight / "hf" / "step_2" / "config.json").is_file()

    resumed = tmp_path / "resumed"
    run(model, resumed, "job.num_steps=1")
    assert "resuming after step 1" in run(model, resumed, "job.num_steps=2")
    # same rows of games.jsonl (data position restored), same samples, same updates (the 1-step run evaluated
    # at its last step, the straight one did not)
    no_eval = lambda table: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in table]  # noqa: E731
    assert no_eval(metric_rows(resumed)) == no_eval(full)


def test_a_broken_class_stops_before_any_process_group(model, monkeypatch, capsys, tmp_path):
    from megatron_rl.job.main import main

    (tmp_path / "bad.py").write_text("class Game:\n    def __init__(self, digits): pass\n"
                                     "    def reset(self): return '1 ?'\n")
    monkeypatch.setenv("RANK", "0")
    code = main(["--config", str(CONFIG), f"model.hf_path={model}", f"job.environment={tmp_path / 'bad.py'}:Game"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: job.environment=" in err and "has no method step(response)" in err, err
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.engine
@pytest.mark.fleet
def test_the_digit_game_class_trains_on_the_vllm_fleet(model, tmp_path):
    from tests.support.engine_env import engine_python

    os.environ.setdefault("MEGATRON_RL_ENGINE_PYTHON", engine_python())
    out_dir = tmp_path / "vllm"
    run(model, out_dir, "job.num_steps=2", "rollout.engine=vllm", "eval.interval=0")
    table = metric_rows(out_dir)
    assert [r["step"] for r in table] == [1, 2]
    for r in table:  # the engine's samples of every turn, scored by the trainer with the same weights
        assert r["episode/turns_mean"] == 3 and r["rollout/failed_samples"] == 0 and r["rollout/engines_alive"] == 1
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4
