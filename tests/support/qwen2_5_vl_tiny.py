"""A tiny random Qwen2.5-VL made with transformers (no downloads), for the vision-language tests.

Language model: 2 layers, hidden 64, 4 query heads / 2 KV heads of 16, q/k/v biases, vocab 256, mrope_section
[2, 3, 3] (sums to head_dim/2 = 8). Vision tower: 2 blocks (block 0 windowed, block 1 full attention), hidden 32,
2 heads, patch 4, temporal patch 2, 2x2 merge, window 16 pixels (2x2 merged patches). Image token 250, vision
start/end 252/253. fp32. Every norm weight and bias is perturbed away from its init, so that a wrong mapping
(swapped norms, a dropped bias) changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
IMAGE_TOKEN, VISION_START, VISION_END = 250, 252, 253
PATCH, TEMPORAL_PATCH, MERGE, CHANNELS = 4, 2, 2, 3


def config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         pad_token_id=0, bos_token_id=None, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE,
                           window_size=16, fullatt_block_indexes=[1], in_chans=CHANNELS),
        image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)


def make_model(seed: int = 0):
    """The tiny ``Qwen2_5_VLForConditionalGeneration`` in eval mode, fp32."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config()).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def save_checkpoint(path: Path, seed: int = 0) -> Path:
    """Save the tiny model with the WordLevel tokenizer of tests/hf/conftest.py."""
    from tests.hf.conftest import save_tokenizer

    make_model(seed).save_pretrained(path)
    save_tokenizer(path)
    return path


def pixel_values(grids: list[tuple[int, int, int]], generator: torch.Generator) -> torch.Tensor:
    """Random ``pixel_values [patches, C*tp*p*p]`` for images of ``(t, h, w)`` patches (as the processor lays
    them out: one row per patch)."""
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, CHANNELS * TEMPORAL_PATCH * PATCH * PATCH, generator=generator)


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    """The placeholder run of one image: vision start, t*h*w/4 image tokens, vision end."""
    t, h, w = grid
    return [VISION_START] + [IMAGE_TOKEN] * (t * h * w // MERGE**2) + [VISION_END]
