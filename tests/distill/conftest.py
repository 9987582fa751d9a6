"""A tiny teacher checkpoint of its own size, saved locally by ``transformers`` (no downloads).

The student is the library's default ``ModelConfig`` (2 layers, hidden 64, vocabulary 128); the teacher is a
Llama of 4 layers, hidden 96, 6 heads, 2 KV heads and vocabulary 129 (>= the student's; TP2 pads it to 130), fp32,
with its norm weights perturbed away from 1 so that a wrong mapping cannot hide. ~1 s to make.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TEACHER_VOCAB = 129


def make_teacher(path: Path, *, vocab: int = TEACHER_VOCAB, seed: int = 7, tokenizer_vocab: int | None = None,
                 shift_tokens: bool = False, heads: int = 6, kv_heads: int = 2, positions: int = 256) -> Path:
    """Save a 4-layer Llama teacher at ``path``; ``tokenizer_vocab``: also a WordLevel tokenizer of that many
    tokens (``shift_tokens``: ids assigned in another order, i.e. another tokenizer); ``heads``/``kv_heads``: 3/1
    gives head size 32, which vLLM's CPU attention needs (16 it does not support); ``positions``: its
    ``max_position_embeddings``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                  max_position_embeddings=positions, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    if tokenizer_vocab is not None:
        save_tokenizer(path, tokenizer_vocab, shift_tokens=shift_tokens)
    return path


def save_tokenizer(path: Path, size: int, *, shift_tokens: bool = False) -> None:
    """A WordLevel tokenizer over t0..t{size-1} (pad 't0'); ``shift_tokens``: t1 and t2 swap ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    if shift_tokens:
        vocab["t1"], vocab["t2"] = 2, 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1", eos_token="t2").save_pretrained(path)


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory) -> Path:
    return make_teacher(tmp_path_factory.mktemp("distill") / "teacher")
