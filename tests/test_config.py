"""Config schema: loading, overrides, round trip, validation messages, every shipped YAML loads."""

from pathlib import Path

import pytest

from megatron_rl.config import (
    MegatronRLConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    validate_config,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, MegatronRLConfig)


def test_shipped_configs_exist():
    assert (CONFIG_DIR / "demo_cpu.yaml").exists()


def test_yaml_then_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 0.5\nbatch:\n  train_batch_size: 8\n")
    cfg = load_config(path, ["optimizer.lr=1e-4", "stepwise.step_wise_trajectories=true"])
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.batch.train_batch_size == 8
    assert cfg.stepwise.step_wise_trajectories is True
    assert cfg.model == MegatronRLConfig().model  # untouched sections keep defaults


def test_dump_and_reload_identical(tmp_path):
    cfg = load_config(None, ["model.hidden_size=32", "algorithm.max_seq_len=64",
                             "batch.micro_batch_size=null", "batch.max_tokens_per_micro_batch=512"])
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optimzer.lr=1"], "did you mean 'optimizer'"),
        (["optimizer.lrr=1"], "did you mean 'optimizer.lr'"),
        (["batch.train_batch_szie=4"], "did you mean 'batch.train_batch_size'"),
        (["optimizer.lr=abc"], "optimizer.lr"),
        (["batch.micro_batch_size=2.5"], "batch.micro_batch_size"),
        (["stepwise.step_wise_trajectories=3"], "stepwise.step_wise_trajectories"),
        (["model.params_dtype=float16"], "model.params_dtype"),
        (["model=3"], "'model' is a section"),
        (["noequals"], "section.key=value"),
    ],
)
def test_unknown_keys_and_wrong_types(overrides, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.loss_reduction=mean"], "algorithm.loss_reduction"),
        (["algorithm.loss_reduction=seq_mean_token_sum_norm"], "algorithm.max_seq_len"),
        (["stepwise.step_wise_trajectories=true", "algorithm.advantage_estimator=gae"], "advantage_estimator"),
        (["stepwise.step_wise_trajectories=true", "algorithm.advantage_estimator=reinforce++"], "temporal"),
        (["stepwise.merge_stepwise_output=true"], "stepwise.merge_stepwise_output"),
        (["batch.train_batch_size=5", "batch.policy_mini_batch_size=2"], "batch.train_batch_size=5"),
        (["batch.train_batch_size=0"], "batch.train_batch_size=0"),
        (["batch.micro_batch_size=-1"], "batch.micro_batch_size=-1"),
        (["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size=0"),
        (["model.num_layers=0"], "model.num_layers=0"),
        (["batch.max_tokens_per_micro_batch=64"], "exactly one of batch.micro_batch_size"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
        (["optimizer.use_distributed_optimizer=true", "optimizer.optimizer=sgd"], "use_distributed_optimizer"),
        (["model.num_query_groups=3"], "model.num_query_groups"),
    ],
)
def test_validation_messages_name_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        load_config(None, overrides)


def test_world_size_divisibility():
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
    validate_config(cfg, world_size=8)
    with pytest.raises(ValueError, match="world size 6 is not divisible"):
        validate_config(cfg, world_size=6)
    with pytest.raises(ValueError, match="world size 6"):
        load_config(None, ["parallel.tensor_model_parallel_size=4"], world_size=6)
