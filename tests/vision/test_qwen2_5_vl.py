"""Qwen2.5-VL and Qwen3.5 multimodal (hf/families/qwen2_5_vl.py, qwen35_vl.py; model/vision_language.py), each
test once per family (``tiny``: tests/support/qwen2_5_vl_tiny.py, qwen35_vl_tiny.py): a tiny random checkpoint
made by transformers loads into the Megatron model with its vision tower and exports back bitwise; a packed batch
of left-padded rows (right-aligned responses) with images of different sizes gives transformers' response
log-probs (one sequence per forward), and the 3-D RoPE positions equal transformers' ``get_rope_index`` per row;
the policy (model/vision_policy.py) gives the same with images in its ``TrainingBatch``, and a trained one resumes
from a distributed checkpoint.

Planted bugs (negative controls, kept): 1-D text positions for the image tokens (what a model without multimodal
RoPE would use) moves the log-probs by 3e-3 (Qwen2.5-VL) / 5e-2 (Qwen3.5) >> the 1e-5 bound; for Qwen3.5,
consecutive mrope sections instead of interleaved ones: 3.8e-3. Measured: the correct path matches within 1e-6 (Qwen2.5-VL bitwise; Qwen3.5's GDN
layers run the same recurrences in another order); the bound is 1e-5 (fp32).
Cost: ~15 s CPU per family (one process: the model, three policies, transformers' reference, a checkpoint).
"""

from pathlib import Path

import pytest
import torch

from tests.support import qwen2_5_vl_tiny

pytestmark = pytest.mark.core

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny) -> Path:
    return tiny.save_checkpoint(tmp_path_factory.mktemp(tiny.__name__.rsplit(".")[-1]) / "tiny")


@pytest.fixture(scope="module")
def model(groups, checkpoint, family):
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.hf.config import load_hf_config, model_config_from_hf
    from megatron_rl.hf.weights import load_hf_weights
    from megatron_rl.model.vision_language import build_vision_language_model

    cfg = model_config_from_hf(checkpoint, base=ModelConfig(attention_backend="local"))
    assert cfg.family == family and (cfg.add_qkv_bias or cfg.linear_attention_freq == [1, 0, 1, 0])
    vlm = build_vision_language_model(cfg, ParallelConfig(), groups, load_hf_config(checkpoint))
    load_hf_weights([vlm], checkpoint, groups, cfg)
    return vlm.eval()


def test_export_round_trips_bitwise_with_the_vision_tower(groups, model, checkpoint, tmp_path, tiny, family):
    from megatron_rl.hf.weights import export_hf
    from tests.support.exports import assert_same_weights

    weight = model.visual.patch_embed.proj.weight
    kept = weight.detach().clone()
    with torch.no_grad():  # the export holds the model's tower, not the source's: move it, then compare
        weight.add_(1.0)
    try:
        export_hf([model], tmp_path / "moved", checkpoint, groups)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    with pytest.raises(AssertionError, match="patch_embed"):
        assert_same_weights(checkpoint, tmp_path / "moved", family)
    export_hf([model], tmp_path / "out", checkpoint, groups)
    source = assert_same_weights(checkpoint, tmp_path / "out", family)
    assert sum("visual." in name for name in source) == tiny.VISION_TENSORS


def test_packed_logprobs_match_transformers_and_a_position_bug_is_caught(model, checkpoint, tiny):
    from megatron_rl.data.packing import pack, unpack_response
    from megatron_rl.hf.config import load_hf_config
    from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
    from megatron_rl.data.mrope import mrope_positions, pack_positions
    from megatron_rl.model.vision_language import mrope_params

    rows, seqs, ids, mask, response_mask, pixels = tiny.batch()
    grids = torch.tensor([g for _, gs, _ in rows for g in gs])
    rope = load_hf_config(checkpoint).text_config.rope_parameters
    section, interleaved = rope["mrope_section"], rope.get("mrope_interleaved", False)
    packed = pack(ids, mask)
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)

    def logprobs(pack_pos: torch.Tensor, interleave: bool = interleaved) -> torch.Tensor:
        with torch.no_grad():
            logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=mrope_params(
                packed, pack_pos, section, interleave), pixel_values=torch.cat([p for p in pixels if p is not None]),
                image_grid_thw=grids)
        lp, _ = vocab_parallel_logprobs_entropy(logits, packed.labels, None, False, valid_vocab_size=tiny.VOCAB)
        return unpack_response(lp, packed, response_mask.shape[1])

    want = tiny.transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
    got = logprobs(pack_positions(positions, mask, packed))
    assert (got - want)[response_mask].abs().max() < TOL
    planted = logprobs(packed.position_ids.reshape(1, -1).expand(3, -1))  # text positions for image tokens
    assert (planted - want)[response_mask].abs().max() > 100 * TOL
    if interleaved:  # Qwen3.5: the sections taken one after the other, as Qwen2.5-VL's
        planted = logprobs(pack_positions(positions, mask, packed), interleave=False)
        assert (planted - want)[response_mask].abs().max() > 100 * TOL


def test_mrope_rows_consecutive_and_interleaved():
    """The row (T 0, H 1, W 2) of each rotary frequency, against transformers' own recomposition for Qwen3.5."""
    from megatron_rl.model.vision_language import mrope_rows

    assert mrope_rows([2, 3, 3], False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert mrope_rows([3, 3, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rows = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 32).clone()  # [3, b, s, D/2]: value = row
    recompose = Qwen3_5TextRotaryEmbedding.recomposition_frequencies
    want = recompose(type("R", (), {"mrope_section": [11, 11, 10]})(), rows)[0, 0, :32]
    assert mrope_rows([11, 11, 10], True).tolist() == want.long().tolist()


def test_image_token_and_grid_mismatch_is_a_clear_error():
    tiny = qwen2_5_vl_tiny  # data only: one family
    from megatron_rl.data.mrope import mrope_positions

    ids = torch.tensor([[5] + tiny.image_tokens((1, 4, 4)) + [6]])
    with pytest.raises(ValueError, match="image tokens"):
        mrope_positions(ids, torch.ones_like(ids), torch.tensor([[1, 4, 8]]), image_token_id=tiny.IMAGE_TOKEN,
                        spatial_merge_size=tiny.MERGE)


def test_policy_with_images_in_the_batch_matches_transformers(groups, checkpoint, tiny):
    """``VisionLanguagePolicy.forward`` on a ``TrainingBatch`` carrying ``pixel_values`` / ``image_grid_thw``
    (one row per micro-batch: the images split between micro-batches) gives transformers' log-probs."""
    from megatron_rl.data.mrope import mrope_positions, row_images
    from tests.support.batches import training_batch

    tensors, (rows, seqs, pixels) = tiny.batch_tensors()
    policy = tiny.vl_policy(checkpoint, groups)
    policy.config.batch.micro_batch_size = 1
    got = policy.forward(training_batch(tensors))["logprobs"]
    _, grids = row_images(tensors["pixel_values"], tensors["image_grid_thw"])
    ids, mask = tensors["sequences"], tensors["attention_mask"]
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)
    want = tiny.transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
    assert (got - want)[tensors["response_mask"].bool()].abs().max() < TOL
    with pytest.raises(ValueError, match="image_grid_thw"):
        policy.forward(training_batch({k: v for k, v in tensors.items() if k != "image_grid_thw"}))


def test_batch_images_survive_concat_and_dp_padding():
    """``batch_images`` right-aligns each row's images, so ``TrainingBatch.concat`` (left-pads narrower tensors)
    and DP padding rows (zeros: no image) keep ``row_images`` exact."""
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.data.mrope import batch_images, row_images
    from tests.support.batches import training_batch

    tensors, _ = qwen2_5_vl_tiny.batch_tensors()
    want = row_images(tensors["pixel_values"], tensors["image_grid_thw"])
    halves = [training_batch({k: v[rows] for k, v in tensors.items()}) for rows in (slice(0, 1), slice(1, 4))]
    halves[0]["pixel_values"], halves[0]["image_grid_thw"] = batch_images([[(want[0][:16], (1, 4, 4))]])
    joined, _ = TrainingBatch.concat(halves).pad_to_multiple(3, 0)
    got = row_images(joined["pixel_values"], joined["image_grid_thw"])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_trained_policy_saves_and_resumes_from_a_distributed_checkpoint(groups, checkpoint, tmp_path, tiny):
    """One SGD step moves the vision tower too; the distributed checkpoint (``checkpoint/dist.py``, the
    model's ``sharded_state_dict``: the tower saved as replicated) gives a fresh policy every tensor back."""
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from tests.model.test_policy_multirank import summed_pg_loss
    from tests.support.batches import training_batch

    policy = tiny.vl_policy(checkpoint, groups)
    tensors, _ = tiny.batch_tensors()
    policy.forward_backward(training_batch(tensors), summed_pg_loss, None)
    policy.optim_step()
    save_checkpoint(policy, tmp_path / "save", {"step": 1})
    trained = {k: v.clone() for k, v in policy.full_state_dict().items()}
    fresh = tiny.vl_policy(checkpoint, groups)
    tower = next(k for k in trained if k.startswith("visual.merger.") and k.endswith("weight"))
    assert not torch.equal(fresh.full_state_dict()[tower], trained[tower])
    assert load_checkpoint(fresh, tmp_path / "save")["step"] == 1
    resumed = fresh.full_state_dict()
    assert sorted(resumed) == sorted(trained) and all(torch.equal(resumed[k], trained[k]) for k in trained)
