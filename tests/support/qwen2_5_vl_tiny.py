"""A tiny random Qwen2.5-VL made with transformers (no downloads), for the vision-language tests, and the
tests' batch of images and text (``batch``, ``batch_tensors``) with its transformers reference
(``transformers_logprobs``).

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
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
"""One image's placeholder in a prompt's text (the processor expands the pad to the image's tokens)."""


def random_png(height: int, width: int, seed: int) -> bytes:
    """A PNG of random pixels (the same for the same seed)."""
    import io

    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
PATCH, TEMPORAL_PATCH, MERGE, CHANNELS = 4, 2, 2, 3
VISION_TENSORS = 30
"""Tensors of its tower: patch embed 1, 2 blocks x 12, merger 5."""


def config(head_dim: int = 16):
    """The tiny model's config; ``head_dim=32`` (2 query heads, 1 KV head, mrope_section [4, 6, 6]) for vLLM,
    whose CPU attention takes head sizes of 32 and up."""
    from transformers import Qwen2_5_VLConfig

    heads, section = (4, [2, 3, 3]) if head_dim == 16 else (64 // head_dim, [4, 6, 6])
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=512,
                         rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                         pad_token_id=0, bos_token_id=None, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE,
                           window_size=16, fullatt_block_indexes=[1], in_chans=CHANNELS),
        image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)


def make_model(seed: int = 0, head_dim: int = 16):
    """The tiny ``Qwen2_5_VLForConditionalGeneration`` in eval mode, fp32."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config(head_dim)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


SPECIAL_TOKENS = {"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": 251, "<|vision_start|>": VISION_START,
                  "<|vision_end|>": VISION_END}


def save_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer over t0..t255 (pad t0, unk t1, eos t2: special, so they split "t10" into t1 + 0) with
    Qwen2.5-VL's vision tokens at 250-253."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB) if i not in SPECIAL_TOKENS.values()} | SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1", eos_token="t2",
                            additional_special_tokens=list(SPECIAL_TOKENS)).save_pretrained(path)


def save_checkpoint(path: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """Save the tiny model with its tokenizer and image processor (patch 4, 2x2 merge, 8x8 to 32x32 pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    make_model(seed, head_dim).save_pretrained(path)
    save_tokenizer(path)
    Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE,
                             min_pixels=8 * 8, max_pixels=32 * 32).save_pretrained(path)
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


def prompt_rows(gen: torch.Generator) -> list[tuple[list[int], list[tuple[int, int, int]], int]]:
    """(prompt tokens, its images' (t, h, w) patch grids, response length): one image, two images of other
    shapes, text only, an image first (1x4x4 -> 4 tokens, 4x8 and 8x4 -> 8, 4x12 -> 12: 3 windows)."""
    def text(n):
        return torch.randint(3, 240, (n,), generator=gen).tolist()

    img = image_tokens
    return [(text(2) + img((1, 4, 4)) + text(3), [(1, 4, 4)], 4),
            (text(1) + img((1, 4, 8)) + text(1) + img((1, 8, 4)) + text(2), [(1, 4, 8), (1, 8, 4)], 6),
            (text(5), [], 3),
            (img((1, 4, 12)) + text(2), [(1, 4, 12)], 5)]


def batch():
    """The tests' batch of ``prompt_rows`` with random responses: ``(rows, seqs, input_ids [b, S], attention_mask,
    response_mask [b, R] bool, per-row pixel values)``; left-padded rows with right-aligned responses, the images' pixel values in row order."""
    gen = torch.Generator().manual_seed(0)
    rows = prompt_rows(gen)
    seqs = [prompt + torch.randint(3, 240, (r,), generator=gen).tolist() for prompt, _, r in rows]
    width, resp = max(map(len, seqs)), max(r for *_, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros(len(rows), resp, dtype=torch.bool)
    for i, (seq, (_, _, r)) in enumerate(zip(seqs, rows)):
        ids[i, width - len(seq):], mask[i, width - len(seq):] = torch.tensor(seq), 1
        response_mask[i, resp - r:] = True
    pixels = [pixel_values(grids, gen) if grids else None for _, grids, _ in rows]
    return rows, seqs, ids, mask, response_mask, pixels


def hf_class():
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def transformers_logprobs(checkpoint, rows, seqs, pixels, width: int, positions: torch.Tensor,
                          model_class=None) -> torch.Tensor:
    """[b, R] response log-probs from transformers (``model_class``, default Qwen2.5-VL), one unpadded sequence
    per forward; checks on the way that ``positions [3, b, S]`` (ours) equal its ``get_rope_index`` on each row's
    valid tokens."""
    hf = (model_class or hf_class()).from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = torch.zeros(len(rows), max(r for *_, r in rows))
    for i, ((_, grids, r), seq) in enumerate(zip(rows, seqs)):
        x = torch.tensor(seq)[None]
        kinds = (x == IMAGE_TOKEN).int()
        thw = torch.tensor(grids) if grids else None
        with torch.no_grad():
            logits = hf(input_ids=x, mm_token_type_ids=kinds, pixel_values=pixels[i], image_grid_thw=thw).logits
            want_pos, _ = hf.model.get_rope_index(x, kinds, thw)
        assert torch.equal(positions[:, i, width - len(seq):], want_pos[:, 0]), f"row {i}: 3-D positions differ"
        lp = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
        out[i, out.shape[1] - r:] = lp[-r:]
    return out


def batch_tensors() -> tuple[dict[str, torch.Tensor], tuple]:
    """``batch()`` as ``TrainingBatch`` tensors (images through ``data/mrope.py: batch_images``, advantages, a
    dropped loss token), and what ``transformers_logprobs`` needs: ``(tensors, (rows, seqs, pixels))``."""
    from megatron_rl.data.mrope import batch_images

    rows, seqs, ids, mask, response_mask, pixels = batch()
    images = []
    for (_, grids, _), row_pixels in zip(rows, pixels):
        sizes = [t * h * w for t, h, w in grids]
        chunks = torch.split(row_pixels, sizes) if grids else []
        images.append(list(zip(chunks, grids)))
    pixel_values, image_grid_thw = batch_images(images)
    loss_mask = response_mask.float()
    loss_mask[0, -1] = 0.0
    advantages = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1)) * response_mask
    tensors = dict(sequences=ids, attention_mask=mask, response_mask=response_mask.long(), loss_mask=loss_mask,
                   advantages=advantages, pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return tensors, (rows, seqs, pixels)


def vl_policy(checkpoint, groups, **parallel):
    """``policy_from_hf`` of the checkpoint (a ``VisionLanguagePolicy``; SGD, lr 0.05, no clipping) under
    ``ParallelConfig(**parallel)``."""
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_rl.hf.weights import policy_from_hf
    from megatron_rl.model.vision_policy import VisionLanguagePolicy

    cfg = MegatronRLConfig(parallel=ParallelConfig(**parallel), seed=1234, model=ModelConfig(attention_backend="local"),
                           optimizer=OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=1e6))
    policy = policy_from_hf(cfg, groups, hf_dir=checkpoint)
    assert isinstance(policy, VisionLanguagePolicy)
    return policy
