"""Write a tiny randomly initialized Qwen3 and its word-level tokenizer into a folder (no downloads).

The model the arithmetic example (``configs/arithmetic_cpu.yaml``) trains with RL from scratch: 2 layers, hidden
64, 2 attention heads of 64 / 2 = 32 dimensions (vLLM's CPU backend needs head_dim >= 32), 17 tokens::

    python examples/arithmetic/make_model.py outputs/arithmetic_model [--seed 0]

The result is an ordinary Hugging Face checkpoint (``config.json``, ``model.safetensors``, tokenizer files):
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it, and so does the main job
(``model.hf_path=folder``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WORDS = [str(d) for d in range(10)] + ["plus", "one", "two", "equals"]


def save_tokenizer(path: Path, words: list[str] = WORDS) -> int:
    """The example's tokenizer: ``<pad> <unk> <eos>`` (ids 0-2) and ``words``; returns its size."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: common.py
    from common import save_word_tokenizer

    return save_word_tokenizer(path, words)


def make_model(path: Path, seed: int = 0, words: list[str] = WORDS) -> Path:
    """The model and tokenizer (``words``: the vocabulary after the 3 special tokens; examples/digit_game reuses
    this with its own)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(path, words)
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=vocab_size, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=2, initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the checkpoint into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialization")
    args = parser.parse_args()
    print(f"tiny Qwen3 written to {make_model(Path(args.out_dir), args.seed)}")
