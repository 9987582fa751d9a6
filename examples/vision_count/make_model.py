"""Write a tiny randomly initialized Qwen2.5-VL, its word-level tokenizer and its image processor into a folder (no
downloads).

The model the image demo (``configs/vision_count_cpu.yaml``) trains with RL from scratch to count the squares of
a picture: language model 2 layers, hidden 64, 2 heads of 32 (vLLM's CPU attention needs head sizes >= 32),
mrope_section [4, 6, 6]; vision tower 2 blocks (one windowed, one full attention), hidden 32, patch 4, 2x2 merge,
so a 32 x 32 picture is 8 x 8 patches and 16 image tokens (one per 8 x 8 pixels); a vocabulary of 15 tokens::

    python examples/vision_count/make_model.py outputs/vision_count_model [--seed 0]

The result is an ordinary Hugging Face checkpoint (``config.json``, ``model.safetensors``, tokenizer and
``preprocessor_config.json``): ``transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)`` loads
it, and so does the main job (``model.hf_path=folder``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WORDS = ["how", "many", "squares", "?", "one", "two", "three", "four"]
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
"""One image's placeholder in a prompt's text (the processor expands the pad to the image's tokens)."""
PATCH, MERGE, SIDE = 4, 2, 32
"""Patch size and spatial merge of the tower; the pictures' side in pixels (the processor keeps 32 x 32)."""


def save_tokenizer(path: Path) -> dict[str, int]:
    """The example's tokenizer: ``<pad> <unk> <eos>`` (ids 0-2), ``WORDS``, then ``VISION_TOKENS``; returns the
    vision tokens' ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: common.py
    from common import SPECIAL, save_word_tokenizer

    save_word_tokenizer(path, WORDS, VISION_TOKENS)
    return {token: len(SPECIAL) + len(WORDS) + i for i, token in enumerate(VISION_TOKENS)}


def config(ids: dict[str, int]):
    """The model's ``Qwen2_5_VLConfig`` for the tokenizer's vision token ``ids``."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.02,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         pad_token_id=0, bos_token_id=None, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE, window_size=16,
                           fullatt_block_indexes=[1], in_chans=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)  # fmt: skip


def make_model(path: Path, seed: int = 0) -> Path:
    """The model, tokenizer and image processor (pictures resized to multiples of 8 pixels, 8 x 8 to 32 x 32)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path.mkdir(parents=True, exist_ok=True)
    ids = save_tokenizer(path)
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config(ids)).to(torch.float32).save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE, min_pixels=8 * 8,
                             max_pixels=SIDE * SIDE).save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the checkpoint into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialization")
    args = parser.parse_args()
    print(f"tiny Qwen2.5-VL written to {make_model(Path(args.out_dir), args.seed)}")
