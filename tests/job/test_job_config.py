"""The job config: the environment chosen from the keys, what single_turn needs, the demo's old keys, the
derived directories, and a round trip through config.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.job.config import dump_job_config, load_job_config

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "configs" / "demo_cpu.yaml"
ARITH = ROOT / "configs" / "arithmetic_cpu.yaml"
GENERIC = ["model.hf_path=some/model", "data.train_files=examples/arithmetic/train.jsonl",
           "reward.function=examples/arithmetic/reward.py:reward"]


def test_the_environment_follows_the_keys():
    assert load_job_config(CPU).environment == "next_digit"
    generic = load_job_config(CPU, GENERIC)
    assert generic.environment == "single_turn" and generic.rl.model.hf_path == str(Path.cwd() / "some/model")
    assert load_job_config(ARITH).environment == "single_turn"


@pytest.mark.parametrize("missing", ["model.hf_path", "data.train_files", "reward.function"])
def test_single_turn_names_what_it_needs(missing):
    overrides = [o for o in GENERIC if not o.startswith(missing)] + ["job.environment=single_turn"]
    with pytest.raises(ConfigError, match=f"single_turn needs {missing}"):
        load_job_config(CPU, overrides)


def test_rules_between_sections():
    with pytest.raises(ConfigError, match="data.val_files is not set"):
        load_job_config(CPU, [*GENERIC, "eval.interval=5"])
    with pytest.raises(ConfigError, match="unset model.hf_path"):
        load_job_config(CPU, ["model.hf_path=x", "job.environment=next_digit"])
    with pytest.raises(ConfigError, match="job.top_p=0.0 is out of range"):
        load_job_config(CPU, ["job.top_p=0"])
    with pytest.raises(ConfigError, match=r"job.environment='chess' is not one of \['auto', 'agent', 'next_digit'"):
        load_job_config(CPU, ["job.environment=chess"])
    with pytest.raises(ConfigError, match="did you mean 'data.train_files'"):
        load_job_config(CPU, ["data.train_file=x.jsonl"])


def test_old_demo_keys_and_directories():
    config = load_job_config(CPU, ["demo.num_steps=7", "demo.num_turns=2", "demo.temperature=0.5",
                                   "logging.output_dir=/tmp/o"])
    assert (config.job.num_steps, config.next_digit.num_turns, config.job.temperature) == (7, 2, 0.5)
    assert config.save_dir == Path("/tmp/o/checkpoints") and config.export_dir == Path("/tmp/o/hf")
    assert load_job_config(CPU, ["export.dir=/x"]).export_dir == Path("/x")


def test_dump_round_trip(tmp_path):
    config = load_job_config(ARITH, ["data.train_files=[a.jsonl, b.parquet]"])
    assert config.data.paths("train_files") == [str(Path.cwd() / "a.jsonl"), str(Path.cwd() / "b.parquet")]
    dump_job_config(config, tmp_path / "config.yaml")
    assert load_job_config(tmp_path / "config.yaml") == config


def test_a_step_api_class_names_what_it_needs():
    step_api = ["job.environment=my_env.py:MyEnv", "model.hf_path=some/model",
                "data.train_files=examples/arithmetic/train.jsonl"]
    assert load_job_config(CPU, [*step_api, "job.max_turns=3"]).job.max_turns == 3
    for missing in ("model.hf_path", "data.train_files"):
        with pytest.raises(ConfigError, match=f"a step-API environment\\) needs {missing}"):
            load_job_config(CPU, [o for o in step_api if not o.startswith(missing)])
    with pytest.raises(ConfigError, match="step_wise_trajectories=false is the one value it cannot take"):
        load_job_config(CPU, [*step_api, "stepwise.step_wise_trajectories=false", "stepwise.merge_stepwise_output=false"])
    with pytest.raises(ConfigError, match="eval.interval=5 but data.val_files is not set"):
        load_job_config(CPU, [*step_api, "eval.interval=5"])


def test_a_step_api_class_or_an_agent_implies_step_wise_training_unless_merging_is_turned_off():
    step_api = ["job.environment=my_env.py:MyEnv", "model.hf_path=some/model", "data.train_files=rows.jsonl"]
    user_job = ROOT / "configs" / "user_job.yaml"  # the base of the generic command
    stepwise = load_job_config(user_job, step_api).rl.stepwise
    assert stepwise.step_wise_trajectories and stepwise.merge_stepwise_output
    off = load_job_config(user_job, [*step_api, "stepwise.merge_stepwise_output=false"]).rl.stepwise
    assert off.step_wise_trajectories and not off.merge_stepwise_output  # the user's explicit choice stands
    single_turn = load_job_config(user_job, GENERIC).rl.stepwise  # nothing implied for one turn per sample
    assert not single_turn.step_wise_trajectories and not single_turn.merge_stepwise_output
    with pytest.raises(ConfigError, match="GAE|gae"):  # a real conflict: refused, not overridden
        load_job_config(user_job, [*step_api, "algorithm.advantage_estimator=gae"])
    for shipped in ("digit_game_cpu.yaml", "tool_agent_cpu.yaml"):  # they leave it implied too
        stepwise = load_job_config(ROOT / "configs" / shipped).rl.stepwise
        assert stepwise.step_wise_trajectories and stepwise.merge_stepwise_output, shipped


def test_a_warm_up_as_long_as_the_run_is_refused_at_load():
    """The rule the ranks' LR scheduler applies (model/optimizer.py), found by the pre-flight: one line."""
    assert load_job_config(CPU, ["job.num_steps=1", "optimizer.lr_warmup_steps=7"])  # 8 optimizer steps
    with pytest.raises(ConfigError, match=r"optimizer.lr_warmup_steps=8 is not below the run's 8 optimizer steps "
                                          r"\(job.num_steps=1 x 8 per RL step\)"):
        load_job_config(CPU, ["job.num_steps=1", "optimizer.lr_warmup_steps=8"])
    with pytest.raises(ConfigError, match="is not below optimizer.lr_decay_steps=6"):
        load_job_config(CPU, ["optimizer.lr_decay_steps=6", "optimizer.lr_warmup_steps=6"])
