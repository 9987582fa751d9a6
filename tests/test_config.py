"""Config schema: loading, overrides, round trip, validation messages, every shipped YAML loads."""

import math
from pathlib import Path

import pytest

import megatron_rl.config as config_module
import megatron_rl.config_rules as config_rules
from megatron_rl.config import (
    ConfigError,
    MegatronRLConfig,
    OptimizerConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)
from megatron_rl.job.config import load_job_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    # the shipped files are the job's: library sections plus its own; the user-job base needs the user's task
    task = ["data.train_files=prompts.jsonl", "reward.function=r.py:f", "model.hf_path=m"]
    cfg = load_job_config(path, task if path.name == "user_job.yaml" else []).rl
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
        (["batch.micro_batch_size=4", "batch.max_tokens_per_micro_batch=64"], "exactly one of batch.micro_batch_size"),
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
    cfg.validate(world_size=8)
    with pytest.raises(ValueError, match="world size 6 is not divisible"):
        cfg.validate(world_size=6)
    with pytest.raises(ValueError, match="world size 6"):
        load_config(None, ["parallel.tensor_model_parallel_size=4"], world_size=6)


# ---------------------------------------------------------------------------------------------------------------
# Every value checked by the dataclass that owns it (one ValueError naming the dotted key, value and range)
# ---------------------------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("optimizer.lr=.inf", "optimizer.lr=inf", "> 0"),
    ("optimizer.lr=.nan", "optimizer.lr=nan", "> 0"),
    ("optimizer.lr=0", "optimizer.lr=0.0", "> 0"),
    ("optimizer.min_lr=-1e-3", "optimizer.min_lr=-0.001", ">= 0"),
    ("optimizer.adam_beta1=1.5", "optimizer.adam_beta1=1.5", "[0, 1)"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2=1.0", "[0, 1)"),
    ("optimizer.adam_eps=0", "optimizer.adam_eps=0.0", "> 0"),
    ("optimizer.clip_grad=-1", "optimizer.clip_grad=-1.0", ">= 0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1", ">= 0"),
    ("optimizer.lr_warmup_steps=-1", "optimizer.lr_warmup_steps=-1", ">= 0"),
    ("optimizer.lr_decay_steps=0", "optimizer.lr_decay_steps=0", ">= 1"),
    ("seed=-1", "seed=-1", "[0, 4294967296)"),
    ("seed=4294967296", "seed=4294967296", "[0, 4294967296)"),
    ("model.rotary_base=.inf", "model.rotary_base=inf", "> 0"),
    ("model.layernorm_epsilon=0", "model.layernorm_epsilon=0.0", "> 0"),
    ("model.kv_channels=0", "model.kv_channels=0", ">= 1"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5", "[0, 1]"),
    ("algorithm.eps_clip_high=0", "algorithm.eps_clip_high=0.0", "> 0"),
    ("algorithm.eps_clip_low=0", "algorithm.eps_clip_low=0.0", "(0, 1]"),
    ("algorithm.kl_loss_coef=.nan", "algorithm.kl_loss_coef=nan", ">= 0"),
    ("algorithm.entropy_loss_coef=.inf", "algorithm.entropy_loss_coef=inf", "finite"),
    ("algorithm.tis_cap=-1", "algorithm.tis_cap=-1.0", "> 0"),
    ("algorithm.is_ratio_low=0", "algorithm.is_ratio_low=0.0", "(0, 1)"),
    ("algorithm.is_ratio_low=1", "algorithm.is_ratio_low=1.0", "(0, 1)"),
    ("algorithm.is_ratio_high=1", "algorithm.is_ratio_high=1.0", "> 1"),
    ("algorithm.is_ratio_high=.inf", "algorithm.is_ratio_high=inf", "> 1"),
    ("algorithm.max_seq_len=0", "algorithm.max_seq_len=0", ">= 1"),
    ("batch.update_epochs_per_batch=0", "batch.update_epochs_per_batch=0", ">= 1"),
    ("checkpoint.save_interval=-1", "checkpoint.save_interval=-1", ">= 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0", ">= 1"),
    ("checkpoint.save_timeout_s=.inf", "checkpoint.save_timeout_s=inf", "> 0"),
    ("logging.log_interval=0", "logging.log_interval=0", ">= 1"),
]


@pytest.mark.parametrize("override, named, valid_range", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_name_key_value_and_range(override, named, valid_range):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert message.startswith(named) and valid_range in message, message


def test_configs_built_in_code_are_checked_on_construction():
    with pytest.raises(ValueError, match=r"optimizer\.lr=inf"):
        OptimizerConfig(lr=math.inf)
    with pytest.raises(ValueError, match=r"optimizer\.min_lr=0\.5 is above optimizer\.lr=0\.1"):
        OptimizerConfig(lr=0.1, min_lr=0.5)
    with pytest.raises(ValueError, match="model.params_dtype='float16'"):
        config_module.ModelConfig(params_dtype="float16")
    with pytest.raises(ValueError, match="seed=-1"):
        MegatronRLConfig(seed=-1)


def test_each_rule_runs_once_per_load(monkeypatch):
    """load_config builds each section from its final values: every section and the root are checked once."""
    calls = []
    real = config_module.check_fields
    counted = lambda obj, prefix: calls.append(prefix) or real(obj, prefix)  # noqa: E731
    monkeypatch.setattr(config_module, "check_fields", counted)  # the root's own fields
    monkeypatch.setattr(config_rules, "check_fields", counted)  # each section's (ConfigSection.__post_init__)
    load_config(None, ["optimizer.lr=1e-4", "optimizer.min_lr=1e-5", "batch.train_batch_size=8"])
    assert sorted(calls) == sorted(["", "parallel.", "model.", "model.lora.", "optimizer.", "algorithm.", "batch.", "stepwise.",
                                    "checkpoint.", "logging.", "critic.", "distillation."])


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("optimizer.learning_rate=1e-4", "'optimizer.lr'"),
        ("learning_rate=1e-4", "'optimizer.lr'"),
        ("optimizer.warmup_steps=3", "'optimizer.lr_warmup_steps'"),
        ("optimizer.lr_warmup=3", "'optimizer.lr_warmup_steps'"),
        ("optimizer.beta1=0.9", "'optimizer.adam_beta1'"),
        ("optimizer.eps=1e-8", "'optimizer.adam_eps'"),
        ("model.eps=1e-5", "'model.layernorm_epsilon'"),
        ("optimizer.grad_clip=1", "'optimizer.clip_grad'"),
        ("optimizer.max_grad_norm=1", "'optimizer.clip_grad'"),
        ("parallel.tp=2", "'parallel.tensor_model_parallel_size'"),
        ("pp=2", "'parallel.pipeline_model_parallel_size'"),
        ("parallel.dp_size=2", "number of processes"),
        ("batch.batch_size=8", "'batch.train_batch_size'"),
        ("batch.n_samples_per_prompt=4", "job.n_samples_per_prompt"),
        ("optimizer.tensor_model_parallel_size=2", "'parallel.tensor_model_parallel_size'"),
        ("optimizer.lr.value=1", "'optimizer.lr' takes a value"),
        ("optimizer.zzzz=1", "valid keys of 'optimizer'"),
        ("demo.num_steps=3", "load_job_config"),
    ],
)
def test_unknown_key_suggestions(override, suggestion):
    with pytest.raises(ValueError, match="unknown config key") as info:
        load_config(None, [override])
    assert suggestion in str(info.value), str(info.value)


def test_missing_unreadable_and_malformed_yaml(tmp_path):
    with pytest.raises(ValueError, match=f"config file {tmp_path / 'nope.yaml'} does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=f"config file {tmp_path} cannot be read"):
        load_config(tmp_path)  # a directory
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: 1e-3\n model: [\n")
    with pytest.raises(ValueError, match=f"config file {bad}: invalid YAML at line 3, column 2"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping of sections"):
        load_config(bad)
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(None, ["optimizer.lr=["])


def test_dump_is_atomic_and_leaves_no_temp_file(tmp_path):
    dump_config(MegatronRLConfig(), tmp_path / "c.yaml")
    dump_config(load_config(None, ["seed=7"]), tmp_path / "c.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]
    assert load_config(tmp_path / "c.yaml").seed == 7


def test_either_or_keys_derive_the_other_as_null(tmp_path):
    """Setting one of batch.micro_batch_size / batch.max_tokens_per_micro_batch in a later layer (the overrides, a
    later file) or over the schema's default nulls the other: derived, not demanded (config_files.EITHER_OR)."""
    assert (load_config(None, ["batch.max_tokens_per_micro_batch=64"]).batch.micro_batch_size) is None
    budget = tmp_path / "budget.yaml"
    budget.write_text("batch:\n  micro_batch_size: null\n  max_tokens_per_micro_batch: 128\n")
    batch = load_config(budget, ["batch.micro_batch_size=2"]).batch
    assert (batch.micro_batch_size, batch.max_tokens_per_micro_batch) == (2, None)
    rows = tmp_path / "rows.yaml"
    rows.write_text("batch:\n  micro_batch_size: 3\n")
    batch = load_config([budget, rows]).batch
    assert (batch.micro_batch_size, batch.max_tokens_per_micro_batch) == (3, None)
    batch = load_config([rows, budget]).batch
    assert (batch.micro_batch_size, batch.max_tokens_per_micro_batch) == (None, 128)
