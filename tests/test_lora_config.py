"""``model.lora.*``: defaults, YAML round trip, and the one-line errors (before any process group)."""

import pytest

from megatron_rl.config import LORA_TARGET_MODULES, dump_config, load_config


def test_lora_defaults_and_round_trip(tmp_path):
    cfg = load_config()
    assert cfg.model.lora.rank == 0 and not cfg.model.lora.enabled
    assert cfg.model.lora.target_modules == list(LORA_TARGET_MODULES)
    cfg = load_config(None, ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.model.lora.scale == 2.0 and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None, ["model.lora.rank=8"]).model.lora.scale == 1.0  # alpha None = rank
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("overrides, needle", [
    (["model.lora.rank=4"], "model.lora.rank=4 is not a rank vLLM can serve"),
    (["model.lora.target_modules=[q_proj,qkv_proj]"], "unknown module 'qkv_proj'"),
    (["model.lora.target_modules=q_proj"], "must be a non-empty list"),
    (["model.lora.target_modules=[q_proj,q_proj]"], "names a module twice"),
    (["model.lora.alpha=0"], "model.lora.alpha=0.0 is out of range"),
    (["model.lora.rank=8", "algorithm.advantage_estimator=gae", "critic.lr=1e-3"], "with a critic"),
    (["model.lora.rank=8", "model.num_moe_experts=4"], "experts carry no adapters"),
    (["lora_rank=8"], "did you mean 'model.lora.rank'"),
])
def test_lora_errors_are_one_line(overrides, needle):
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
