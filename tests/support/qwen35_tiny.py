"""A tiny random Qwen3.5 made with transformers (no downloads), for the hybrid Gated-DeltaNet tests.

4 layers (GDN, attention, GDN, attention), hidden 64, 4 query heads / 2 KV heads of 32 (RoPE on a quarter of
each head), GDN 2 key heads / 4 value heads of 32, vocab 256, fp32. Every norm weight, A_log and dt_bias is
perturbed away from its init, so that a wrong mapping (a zero-centred norm loaded as a plain one, GDN gates
swapped) changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=LAYER_TYPES,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                  linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0,
                  bos_token_id=None, eos_token_id=2)
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def make_model(seed: int = 0, **overrides):
    """The tiny ``Qwen3_5ForCausalLM`` in eval mode, fp32."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(**overrides)).eval()
    _perturb(model, seed + 1)
    return model


def save_checkpoint(path: Path, multimodal: bool = False, seed: int = 0, **overrides) -> Path:
    """Save the tiny model (text-only, or wrapped in the multimodal layout with a one-block vision tower) with
    the WordLevel tokenizer of tests/hf/conftest.py."""
    from tests.hf.conftest import save_tokenizer

    text = make_model(seed, **overrides)
    if multimodal:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        text_config = text.config.to_dict()  # the multimodal RoPE fields as the published checkpoints have them
        text_config["rope_parameters"] |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
        config = Qwen3_5Config(text_config=text_config, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
        model = Qwen3_5ForConditionalGeneration(config).eval()
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    else:
        model = text
    model.save_pretrained(path)
    save_tokenizer(path)
    return path
