"""Qwen2.5-VL (hf/families/qwen2_5_vl.py, model/vision_language.py): a tiny random checkpoint made by transformers
loads into the Megatron model with its vision tower and exports back bitwise; a packed batch of left-padded rows
(right-aligned responses) with images of different sizes gives transformers' response log-probs (one sequence per
forward), and the 3-D RoPE positions equal transformers' ``get_rope_index`` per row; the policy
(model/vision_policy.py) gives the same with images in its ``TrainingBatch``, and a trained one resumes from a
distributed checkpoint.

Planted bug (negative control, kept): 1-D text positions for the image tokens (what a model without multimodal
RoPE would use) moves the log-probs by ~3e-3 >> the 1e-5 bound. Measured: the correct path matches bitwise
(0.0) on this machine; the bound is 1e-5 (fp32, the same formulas in another order elsewhere).
Cost: ~15 s CPU (one process: the model, three policies, transformers' reference, a checkpoint).
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


def test_packed_logprobs_match_transformers_and_a_position_bug_is_caught(model, checkpoint):
    from megatron_rl.data.packing import pack, unpack_response
    from megatron_rl.hf.config import load_hf_config
    from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
    from megatron_rl.data.mrope import mrope_positions, pack_positions
    from megatron_rl.model.vision_language import mrope_params

    rows, seqs, ids, mask, response_mask, pixels = tiny.batch()
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

    want = tiny.transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
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


def test_policy_with_images_in_the_batch_matches_transformers(groups, checkpoint):
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


@pytest.mark.parametrize("layout", [dict(pipeline_model_parallel_size=2), dict(context_parallel_size=2)])
def test_unsupported_layouts_are_refused_in_one_line(groups, checkpoint, layout):
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.hf.config import load_hf_config, model_config_from_hf
    from megatron_rl.model.vision_language import build_vision_language_model

    cfg = model_config_from_hf(checkpoint, base=ModelConfig(attention_backend="local"))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1, context_parallel_size=1"):
        build_vision_language_model(cfg, ParallelConfig(**layout), groups, load_hf_config(checkpoint))


def test_batch_images_survive_concat_and_dp_padding():
    """``batch_images`` right-aligns each row's images, so ``TrainingBatch.concat`` (left-pads narrower tensors)
    and DP padding rows (zeros: no image) keep ``row_images`` exact."""
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.data.mrope import batch_images, row_images
    from tests.support.batches import training_batch

    tensors, _ = tiny.batch_tensors()
    want = row_images(tensors["pixel_values"], tensors["image_grid_thw"])
    halves = [training_batch({k: v[rows] for k, v in tensors.items()}) for rows in (slice(0, 1), slice(1, 4))]
    halves[0]["pixel_values"], halves[0]["image_grid_thw"] = batch_images([[(want[0][:16], (1, 4, 4))]])
    joined, _ = TrainingBatch.concat(halves).pad_to_multiple(3, 0)
    got = row_images(joined["pixel_values"], joined["image_grid_thw"])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_trained_policy_saves_and_resumes_from_a_distributed_checkpoint(groups, checkpoint, tmp_path):
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
    assert not torch.equal(fresh.full_state_dict()["visual.merger.mlp.2.weight"], trained["visual.merger.mlp.2.weight"])
    assert load_checkpoint(fresh, tmp_path / "save")["step"] == 1
    resumed = fresh.full_state_dict()
    assert sorted(resumed) == sorted(trained) and all(torch.equal(resumed[k], trained[k]) for k in trained)
