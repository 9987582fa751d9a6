"""The engine pre-flight reads the model it will run: with ``model.hf_path`` the checkpoint's head size, not the
``model.*`` keys of the config file (a Qwen3 with 2 heads of 32 was refused because the demo config says 4 x 16):
the job's model section as ``load_job_config`` resolves it (``job/config.py: with_checkpoint_model``)."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, MegatronRLConfig, ModelConfig
from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.registry import check_engine_config


def _hf(tmp_path, **shapes):
    shapes.setdefault("num_key_value_heads", shapes["num_attention_heads"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **shapes}))
    return str(tmp_path)


def resolved(model: ModelConfig) -> ModelConfig:
    """The model section as the job reads it (the checkpoint's shapes over the config keys)."""
    from megatron_rl.job.config import with_checkpoint_model

    return with_checkpoint_model(MegatronRLConfig(model=model)).model


def test_hf_checkpoint_shapes_are_checked_not_the_config_keys(tmp_path):
    rollout = RolloutConfig(engine="vllm")
    config_keys = dict(hidden_size=64, num_attention_heads=4)  # 16: refused on their own
    with pytest.raises(ConfigError, match="model.num_attention_heads=4 gives 16"):
        check_engine_config(rollout, ModelConfig(**config_keys), "cpu")
    ok = _hf(tmp_path, hidden_size=64, num_attention_heads=2, head_dim=32)
    check_engine_config(rollout, resolved(ModelConfig(**config_keys, hf_path=ok)), "cpu")


def test_hf_checkpoint_with_an_unsupported_head_size_names_the_path(tmp_path):
    bad = _hf(tmp_path, hidden_size=64, num_attention_heads=4, head_dim=16)
    with pytest.raises(ConfigError, match=r"model.hf_path=.* has a head size of 16"):
        check_engine_config(RolloutConfig(engine="vllm"), resolved(ModelConfig(hf_path=bad)), "cpu")
    check_engine_config(RolloutConfig(engine="vllm"), resolved(ModelConfig(hf_path=bad)), "cuda")  # GPU kernels: any size


def test_sleep_while_training_is_for_gpus():
    rollout = RolloutConfig(engine="vllm", sleep_while_training=True)
    model = ModelConfig(hidden_size=64, num_attention_heads=2)
    with pytest.raises(ConfigError, match="rollout.sleep_while_training=true frees GPU memory"):
        check_engine_config(rollout, model, "cpu")
    check_engine_config(rollout, model, "cuda")
