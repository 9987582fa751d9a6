"""Qwen2.5-VL (hf/families/qwen2_5_vl.py, model/vision_language.py): a tiny random checkpoint made by transformers
loads into the Megatron model with its vision tower and exports back bitwise; a packed batch of left-padded rows
(right-aligned responses) with images of different sizes gives transformers' response log-probs (one sequence per
forward), and the 3-D RoPE positions equal transformers' ``get_rope_index`` per row.

Planted bug (negative control, kept): 1-D text positions for the image tokens (what a model without multimodal
RoPE would use) moves the log-probs by ~3e-3 >> the 1e-5 bound. Measured: the correct path matches bitwise
(0.0) on this machine; the bound is 1e-5 (fp32, the same formulas in another order elsewhere).
Cost: ~6 s (one process; building the model and transformers' reference).
"""

from pathlib import Path

import pytest
import torch

from tests.support import qwen2_5_vl_tiny as tiny

pytestmark = pytest.mark.core

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny.save_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny")


@pytest.fixture(scope="module")
def model(groups, checkpoint):
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.hf.config import load_hf_config, model_config_from_hf
    from megatron_rl.hf.weights import load_hf_weights
    from megatron_rl.model.vision_language import build_vision_language_model

    cfg = model_config_from_hf(checkpoint, base=ModelConfig(attention_backend="local"))
    assert cfg.family == "qwen2_5_vl" and cfg.add_qkv_bias
    vlm = build_vision_language_model(cfg, ParallelConfig(), groups, load_hf_config(checkpoint))
    load_hf_weights([vlm], checkpoint, groups, cfg)
    return vlm.eval()


def test_export_round_trips_bitwise_with_the_vision_tower(groups, model, checkpoint, tmp_path):
    from megatron_rl.hf.weights import export_hf
    from tests.support.exports import assert_same_weights

    export_hf([model], tmp_path / "out", checkpoint, groups)
    source = assert_same_weights(checkpoint, tmp_path / "out", "qwen2_5_vl")
    assert sum(name.startswith("visual.") for name in source) == 30  # patch embed, 2 blocks x 12, merger 5


def _rows(gen: torch.Generator) -> list[tuple[list[int], list[tuple[int, int, int]], int]]:
    """(prompt tokens, its images' (t, h, w) patch grids, response length): one image, two images of other
    shapes, text only, an image first (1x4x4 -> 4 tokens, 4x8 and 8x4 -> 8, 4x12 -> 12: 3 windows)."""
    def text(n):
        return torch.randint(3, 240, (n,), generator=gen).tolist()

    img = tiny.image_tokens
    return [(text(2) + img((1, 4, 4)) + text(3), [(1, 4, 4)], 4),
            (text(1) + img((1, 4, 8)) + text(1) + img((1, 8, 4)) + text(2), [(1, 4, 8), (1, 8, 4)], 6),
            (text(5), [], 3),
            (img((1, 4, 12)) + text(2), [(1, 4, 12)], 5)]


def _batch():
    """Left-padded rows with right-aligned responses, the images' pixel values in row order."""
    gen = torch.Generator().manual_seed(0)
    rows = _rows(gen)
    seqs = [prompt + torch.randint(3, 240, (r,), generator=gen).tolist() for prompt, _, r in rows]
    width, resp = max(map(len, seqs)), max(r for *_, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros(len(rows), resp, dtype=torch.bool)
    for i, (seq, (_, _, r)) in enumerate(zip(seqs, rows)):
        ids[i, width - len(seq):], mask[i, width - len(seq):] = torch.tensor(seq), 1
        response_mask[i, resp - r:] = True
    pixels = [tiny.pixel_values(grids, gen) if grids else None for _, grids, _ in rows]
    return rows, seqs, ids, mask, response_mask, pixels


def _transformers_logprobs(checkpoint, rows, seqs, pixels, width: int, positions: torch.Tensor) -> torch.Tensor:
    """[b, R] response log-probs from transformers, one unpadded sequence per forward; checks on the way that
    ``positions [3, b, S]`` (ours) equal its ``get_rope_index`` on each row's valid tokens."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = torch.zeros(len(rows), max(r for *_, r in rows))
    for i, ((_, grids, r), seq) in enumerate(zip(rows, seqs)):
        x = torch.tensor(seq)[None]
        kinds = (x == tiny.IMAGE_TOKEN).int()
        thw = torch.tensor(grids) if grids else None
        with torch.no_grad():
            logits = hf(input_ids=x, mm_token_type_ids=kinds, pixel_values=pixels[i], image_grid_thw=thw).logits
            want_pos, _ = hf.model.get_rope_index(x, kinds, thw)
        assert torch.equal(positions[:, i, width - len(seq):], want_pos[:, 0]), f"row {i}: 3-D positions differ"
        lp = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
        out[i, out.shape[1] - r:] = lp[-r:]
    return out


def test_packed_logprobs_match_transformers_and_a_position_bug_is_caught(model, checkpoint):
    from megatron_rl.data.packing import pack, unpack_response
    from megatron_rl.hf.config import load_hf_config
    from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
    from megatron_rl.data.mrope import mrope_positions, pack_positions
    from megatron_rl.model.vision_language import mrope_params

    rows, seqs, ids, mask, response_mask, pixels = _batch()
    grids = torch.tensor([g for _, gs, _ in rows for g in gs])
    section = load_hf_config(checkpoint).text_config.rope_parameters["mrope_section"]
    packed = pack(ids, mask)
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)

    def logprobs(pack_pos: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=mrope_params(
                packed, pack_pos, section), pixel_values=torch.cat([p for p in pixels if p is not None]),
                image_grid_thw=grids)
        lp, _ = vocab_parallel_logprobs_entropy(logits, packed.labels, None, False, valid_vocab_size=tiny.VOCAB)
        return unpack_response(lp, packed, response_mask.shape[1])

    want = _transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
    got = logprobs(pack_positions(positions, mask, packed))
    assert (got - want)[response_mask].abs().max() < TOL
    planted = logprobs(packed.position_ids.reshape(1, -1).expand(3, -1))  # text positions for image tokens
    assert (planted - want)[response_mask].abs().max() > 100 * TOL


def test_image_token_and_grid_mismatch_is_a_clear_error():
    from megatron_rl.data.mrope import mrope_positions

    ids = torch.tensor([[5] + tiny.image_tokens((1, 4, 4)) + [6]])
    with pytest.raises(ValueError, match="image tokens"):
        mrope_positions(ids, torch.ones_like(ids), torch.tensor([[1, 4, 8]]), image_token_id=tiny.IMAGE_TOKEN,
                        spatial_merge_size=tiny.MERGE)
