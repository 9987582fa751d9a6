"""Tiny random Hugging Face checkpoints saved locally (no downloads), one per supported variant.

Each model: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256 (255 for one, which TP2 pads), fp32, plus a WordLevel tokenizer with a pad
token. Norm weights and biases are perturbed away from their 1/0 init so that a wrong mapping (e.g. the
input norm loaded into the MLP norm, a bias dropped) changes the logits and cannot hide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 256
VARIANTS = {
    # name: (model_type, extra config kwargs)
    "llama": ("llama", {"rope_theta": 50000.0}),
    "qwen2": ("qwen2", {"rope_theta": 1000000.0}),  # q/k/v biases
    "qwen3": ("qwen3", {"rope_theta": 1000000.0, "head_dim": 32}),  # q/k norms, head_dim != hidden/heads
    "qwen2_tied": ("qwen2", {"rope_theta": 10000.0, "tie_word_embeddings": True}),
    "llama_v255": ("llama", {"rope_theta": 10000.0, "vocab_size": 255}),  # padded to 256 under TP2
}


def _hf_config(model_type: str, extra: dict):
    from transformers import AutoConfig

    extra = dict(extra)
    theta = extra.pop("rope_theta")
    vocab = extra.pop("vocab_size", VOCAB)
    return AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        pad_token_id=0,
        **extra,
    )


def _perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


def save_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer over tokens t0..t255 with pad token 't0' (id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1", eos_token="t2").save_pretrained(path)


def make_tiny_hf_model(path: Path, variant: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    model_type, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(model_type, extra), dtype=torch.float32)
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {name: make_tiny_hf_model(root / name, name, seed=i) for i, name in enumerate(VARIANTS)}
