"""A tiny random Qwen3.5 multimodal model (``Qwen3_5ForConditionalGeneration``) made with transformers (no
downloads), for the vision-language tests: the same interface as ``qwen2_5_vl_tiny`` (``save_checkpoint``,
``batch_tensors``, ``transformers_logprobs``, ``vl_policy``, ``IMAGE_TOKEN``, ``MERGE``...), so a test takes either
module as its ``tiny``.

Language model: the hybrid of ``qwen35_tiny`` (4 layers: GDN, attention, GDN, attention; hidden 64, 4 query heads
/ 2 KV heads of 32, GDN 2 key / 4 value heads of 32, vocab 256) with RoPE on half of each head (16 channels:
``mrope_section`` [3, 3, 2] over 8 frequencies, interleaved T H W T H W T H as the published checkpoints say
with ``mrope_interleaved: true``). Vision tower (``Qwen3_5VisionModel``): 2 blocks, hidden 32, 2 heads, patch 4,
temporal patch 2, 2x2 merge, a learned 8x8 position grid (bilinearly resampled per image), no deepstack (the
Qwen3.5 tower has none). Image token 250, vision start/end 252/253; the tokenizer and image processor of
``qwen2_5_vl_tiny`` (the same placeholder ``IMAGE``). fp32. Every norm weight and bias, ``A_log`` and ``dt_bias``
is perturbed away from its init, so that a wrong mapping changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support import qwen2_5_vl_tiny as _vl
from tests.support.qwen35_tiny import LAYER_TYPES

VOCAB, IMAGE_TOKEN, VISION_START, VISION_END = _vl.VOCAB, _vl.IMAGE_TOKEN, _vl.VISION_START, _vl.VISION_END
IMAGE, PATCH, TEMPORAL_PATCH, MERGE, CHANNELS = _vl.IMAGE, _vl.PATCH, _vl.TEMPORAL_PATCH, _vl.MERGE, _vl.CHANNELS
MROPE_SECTION = [3, 3, 2]
VISION_TENSORS = 33
"""Tensors of its tower: patch embed 2, position grid 1, 2 blocks x 12, merger 6 (norm, fc1, fc2)."""
random_png, pixel_values, image_tokens, prompt_rows, batch = (
    _vl.random_png, _vl.pixel_values, _vl.image_tokens, _vl.prompt_rows, _vl.batch)


def config(head_dim: int = 32, **text_overrides):
    from transformers import Qwen3_5Config

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=LAYER_TYPES,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=None, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": MROPE_SECTION, "mrope_interleaved": True}) | text_overrides
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE, in_channels=CHANNELS,
                  num_position_embeddings=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=251,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False)


def make_model(seed: int = 0, head_dim: int = 32, **text_overrides):
    """The tiny ``Qwen3_5ForConditionalGeneration`` in eval mode, fp32 (``text_overrides``: text config fields)."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config(head_dim, **text_overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".bias", "A_log", "dt_bias")):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def save_checkpoint(path: Path, seed: int = 0, head_dim: int = 32, **text_overrides) -> Path:
    """Save the tiny model with the tokenizer and image processor of ``qwen2_5_vl_tiny``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    make_model(seed, head_dim, **text_overrides).save_pretrained(path)
    _vl.save_tokenizer(path)
    Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE,
                             min_pixels=8 * 8, max_pixels=32 * 32).save_pretrained(path)
    return path


def hf_class():
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration


def transformers_logprobs(checkpoint, rows, seqs, pixels, width: int, positions: torch.Tensor) -> torch.Tensor:
    """``qwen2_5_vl_tiny.transformers_logprobs`` with transformers' Qwen3.5."""
    return _vl.transformers_logprobs(checkpoint, rows, seqs, pixels, width, positions, hf_class())


def batch_tensors():
    return _vl.batch_tensors()


def vl_policy(checkpoint, groups, **parallel):
    return _vl.vl_policy(checkpoint, groups, **parallel)
