"""HF config.json -> ModelConfig, tokenizer loading, and their errors (single process, no Megatron)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from megatron_rl.config import ModelConfig
from megatron_rl.hf.config import model_config_from_hf
from megatron_rl.hf.tokenizer import load_tokenizer, pad_token_id


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "qwen2_tied", "llama_v255"])
def test_model_config_matches_hf_config(hf_models, variant):
    path = hf_models[variant]
    hf = AutoConfig.from_pretrained(path)
    cfg = model_config_from_hf(path, base=ModelConfig(init_method_std=0.5))
    assert cfg.hf_path == str(path) and cfg.init_method_std == 0.5
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size) == (4, 2, hf.vocab_size)
    assert cfg.kv_channels == (32 if variant == "qwen3" else 16)
    assert cfg.rotary_base == hf.rope_parameters["rope_theta"]
    assert cfg.layernorm_epsilon == hf.rms_norm_eps
    assert cfg.add_qkv_bias == variant.startswith("qwen2")
    assert cfg.qk_layernorm == (variant == "qwen3")
    assert cfg.share_embeddings_and_output_weights == (variant == "qwen2_tied")
    assert cfg.max_position_embeddings == hf.max_position_embeddings


def _edit_config(src, dst, **changes):
    dst.mkdir()
    data = json.loads((src / "config.json").read_text())
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_unsupported_architecture_and_features_are_value_errors(hf_models, tmp_path):
    src = hf_models["llama"]
    with pytest.raises(ValueError, match="model_type='gpt2'.*llama, qwen2, qwen3"):
        model_config_from_hf(_edit_config(src, tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="no config.json"):
        model_config_from_hf(tmp_path)
    scaled = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="RoPE scaling rope_type='llama3'"):
        model_config_from_hf(_edit_config(src, tmp_path / "scaled", rope_parameters=scaled))
    with pytest.raises(ValueError, match="attention_bias=True"):
        model_config_from_hf(_edit_config(src, tmp_path / "bias", attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        model_config_from_hf(_edit_config(src, tmp_path / "gelu", hidden_act="gelu"))


def test_tokenizer_and_pad_token(hf_models, tmp_path):
    assert pad_token_id(load_tokenizer(hf_models["qwen2"])) == 0
    # transformers 5 maps model_type qwen2 to its own BPE tokenizer class and rebuilds the pipeline from the
    # vocab, so the WordLevel test tokenizer splits text only under llama's generic backend
    tok = load_tokenizer(hf_models["llama"])
    assert tok("t5 t7")["input_ids"] == [5, 7]
    tok.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        pad_token_id(tok, "here")
    with pytest.raises(ValueError, match="no loadable tokenizer|not a directory"):
        load_tokenizer(tmp_path)


def test_errors_name_the_directory_as_the_caller_set_it(hf_models, tmp_path):
    """``hf_dir=`` passed to a function is named ``hf_dir=...``; the config's ``model.hf_path`` is named so.
    Both are found before any collective (no process group here: ``groups=None``)."""
    import dataclasses

    from megatron_rl.config import MegatronRLConfig
    from megatron_rl.hf import policy_from_hf

    empty = tmp_path / "empty"
    empty.mkdir()
    config = MegatronRLConfig()
    with pytest.raises(ValueError, match=f"^hf_dir='{empty}' has no config.json"):
        policy_from_hf(config, None, hf_dir=empty)
    from_config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_path=str(empty)))
    with pytest.raises(ValueError, match=f"^model.hf_path='{empty}' has no config.json"):
        policy_from_hf(from_config, None)
    with pytest.raises(ValueError, match=f"^hf_dir='{empty}': no loadable tokenizer"):
        load_tokenizer(empty)
    with pytest.raises(ValueError, match=f"^hf_dir='{empty}' has no config.json"):
        model_config_from_hf(empty)
