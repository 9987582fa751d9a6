"""A vision-language policy (model/vision_policy.py; Qwen2.5-VL and the hybrid Qwen3.5, ``family``) with images in
the batch: its log-probs equal transformers' per sequence, and the step's loss, gradients (vision tower included)
and grad norm do not depend on micro-batching, DP2, TP2, PP2, TP2+SP or CP2 (docs/VISION.md section 2: the tower
is replicated over TP, its gradients agree there without a reduction and the grad norm counts it once; under PP
it is the first stage's and the later stages get the 3-D positions only; under SP the image rows replace the
embedding's before the scatter; under CP each rank keeps its tokens' image rows; Qwen3.5's hybrid model refuses
CP, skipped). At PP2 also the weights: the HF export (bitwise the source), the per-stage weight stream (the tower
from stage 0 only) and the distributed checkpoint (resumed by a fresh PP2 policy, every tensor equal); and the
built-in engine's KV-cache decoding with images (Qwen2.5-VL) gives the full-forward path's tokens and log-probs
(1e-5; planted: the rope deltas dropped, 4.8e-3).

Planted bugs, each failing this test: the Gated-DeltaNet output norm's gradient left partial over TP without
sequence parallelism (``model/hybrid.py: HeadsRMSNorm`` as a plain ``RMSNorm``; found by this test, kept fixed):
Qwen3.5 TP2 relative gradient error 6.5e-4; 1-D text positions on stage 1: PP2 log-probs 1.7e-3 (Qwen2.5-VL) /
4.2e-2 (Qwen3.5) off; the image rows replaced after the SP scatter (each rank its own): gradients 3.7e-2 / 4.1e-2
off; CP: a rank's image tokens taking the tower's first rows, 4.5e-3, or text positions, 3.0e-3.

Reference: the single-process policy with one micro-batch (in this process). ONE 2-rank spawn per family runs
the layouts in turn, each with 2 micro-batches per rank (images split between micro-batches). Tolerances: fp32
with another reduction order, relative 1e-5 (as tests/model/test_hybrid_multirank.py). Cost: one 2-rank spawn per
family, ~10 s wall each on a quiet machine (all five layouts; 40-100 s on a loaded one).
"""

from __future__ import annotations

import pytest
import torch

from tests.vision.conftest import FAMILIES
from tests.support.batches import max_rel_err, steps_per_count, training_batch
from tests.support.multirank import run_ranks
from tests.model.test_policy_multirank import summed_pg_loss

pytestmark = [pytest.mark.multirank, pytest.mark.core]

LAYOUTS = {"dp2": dict(), "tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2),
           "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True), "cp2": dict(context_parallel_size=2)}
HYBRID_REFUSES = {"cp2"}
"""Layouts Qwen3.5's hybrid language model refuses (model/hybrid.py: CP), skipped for that family."""
COUNTS = (1, 2)


def _runs(policy, groups, tensors, counts) -> dict:
    """Loss and finalized gradients per micro-batch count, then the grad norm of one optimizer step."""
    batch = training_batch(tensors)
    out = {"logprobs": policy.forward(batch)["logprobs"]}
    return {**out, **steps_per_count(policy, batch, groups, counts, summed_pg_loss)}


def _stage_weights(policy, groups, checkpoint, out) -> dict:
    """PP2, before the step: the HF export (rank 0 writes ``out``) and this stage's weight-sync stream, as
    ``{name: tensor}`` (the tower belongs to stage 0)."""
    from megatron_rl.hf.weights import export_policy_to_hf, iter_hf_weights, iter_stage_hf_weights

    export_policy_to_hf(policy, out, checkpoint)
    exported = [name for name, _ in iter_hf_weights([policy.module], checkpoint, groups)]  # every rank: all names
    stream = {name: tensor.cpu().clone() for name, tensor in iter_stage_hf_weights([policy.module], checkpoint, groups)}
    return {"exported": exported, "stream": stream}


def _resumed(policy, groups, checkpoint, out, family, parallel) -> dict:
    """PP2, after the step: the distributed checkpoint saved and loaded into a fresh policy, both full state dicts."""
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(policy, out, {"step": 1})
    trained = policy.full_state_dict()
    fresh = FAMILIES[family].vl_policy(checkpoint, groups, **parallel)
    load_checkpoint(fresh, out)
    return {"trained": trained, "resumed": fresh.full_state_dict()}


def _has_pixels(policy, tensors) -> bool:
    """Whether this rank's planned micro-batches hold image pixels (under PP: the first stage's only)."""
    plan = policy.plan_call(training_batch(tensors))
    return any(m.packed.pixel_values is not None or "pixel_values" in m.tensors for m in plan.microbatches)


def _decoded(policy, family) -> dict | None:
    """PP2: the built-in engine's samples through its KV cache with images (3-D positions offset by each row's
    rope delta on both stages) and through full forwards, same seed: tokens and log-probs (None: a family whose
    engine decodes by full forwards only, Qwen3.5's hybrid)."""
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec

    tiny = FAMILIES[family]
    cached_engine = BuiltinEngine.from_policy(policy, 0)
    if cached_engine.decoder is None:
        return None
    gen = torch.Generator().manual_seed(0)
    rows = tiny.prompt_rows(gen)
    images = []
    for _, grids, _ in rows:
        pixels = torch.split(tiny.pixel_values(grids, gen), [t * h * w for t, h, w in grids]) if grids else []
        images.append(list(zip(pixels, grids)))
    spec = SamplingSpec(max_tokens=4, temperature=1.0)
    out = {}
    for name, engine in (("cached", cached_engine), ("full", BuiltinEngine.from_policy(policy, 0, kv_cache=False))):
        completions = engine.generate([prompt for prompt, _, _ in rows], spec, seed=7, images=images)
        out[name] = ([c.token_ids for c in completions], [c.logprobs for c in completions])
    return out


def _layouts_rank(rank, world_size, checkpoint, tensors, family, tmp):
    from megatron_rl.config import ParallelConfig
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    results = {}
    for name, parallel in LAYOUTS.items():
        if family == "qwen35_vl" and name in HYBRID_REFUSES:
            continue
        groups = initialize_distributed(ParallelConfig(**parallel), 1234)
        try:
            policy = FAMILIES[family].vl_policy(checkpoint, groups, **parallel)
            weights = _stage_weights(policy, groups, checkpoint, tmp / "export") if name == "pp2" else {}
            decoded = _decoded(policy, family) if name == "pp2" else None
            results[name] = _runs(policy, groups, tensors, (2,))
            if name == "pp2":
                results[name].update(**weights, pixels=_has_pixels(policy, tensors), decoded=decoded,
                                     **_resumed(policy, groups, checkpoint, tmp / "dist", family, parallel))
        finally:
            destroy_distributed(keep_process_group=True)  # the next layout reuses the process group
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny):
    return tiny.save_checkpoint(tmp_path_factory.mktemp("vl_mr") / "tiny")


@pytest.fixture(scope="module")
def reference(checkpoint, tiny):
    from megatron_rl.config import ParallelConfig
    from megatron_rl.data.mrope import mrope_positions, row_images
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    tensors, (rows, seqs, pixels) = tiny.batch_tensors()
    groups = initialize_distributed(ParallelConfig(), 1234)
    try:
        ref = _runs(tiny.vl_policy(checkpoint, groups), groups, tensors, COUNTS)
    finally:
        destroy_distributed()
    ids, mask = tensors["sequences"], tensors["attention_mask"]
    _, grids = row_images(tensors["pixel_values"], tensors["image_grid_thw"])
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)
    ref["transformers"] = tiny.transformers_logprobs(checkpoint, rows, seqs, pixels, ids.shape[1], positions)
    return tensors, ref


def test_policy_logprobs_loss_grads_and_grad_norm_match_across_layouts(checkpoint, reference, family, tiny,
                                                                        tmp_path):
    from safetensors.torch import load_file

    from tests.support.exports import assert_same_weights

    tensors, ref = reference
    mask = tensors["response_mask"].bool()
    assert (ref["logprobs"] - ref["transformers"])[mask].abs().max() < 1e-5
    assert ref["loss_1"] != 0.0 and float(ref["grad_1"]["visual.patch_embed.proj.weight"].norm()) > 0
    assert max_rel_err(ref["grad_2"], ref["grad_1"]) < 1e-5
    ranks = run_ranks(2, _layouts_rank, checkpoint, tensors, family, tmp_path, timeout=600)
    # PP2 weights: the export is the source bitwise, the tower streamed by stage 0 only, the dist checkpoint resumes
    assert_same_weights(checkpoint, tmp_path / "export", f"{family} pp2 export")
    source = load_file(checkpoint / "model.safetensors")
    streams = [rank_results["pp2"]["stream"] for rank_results in ranks]
    towers = [sum("visual." in name for name in stream) for stream in streams]
    assert towers == [tiny.VISION_TENSORS, 0] and len(streams[0]) > towers[0] and len(streams[1]) > 0
    assert not set(streams[0]) & set(streams[1]) and set(streams[0]) | set(streams[1]) == set(source)
    assert all(sorted(rank_results["pp2"]["exported"]) == sorted(source) for rank_results in ranks)
    assert [rank_results["pp2"]["pixels"] for rank_results in ranks] == [True, False]
    for rank_results in ranks:  # the KV cache with images at PP2: stage 1 continues the 3-D positions too
        decoded = rank_results["pp2"]["decoded"]
        assert (decoded is None) == (family == "qwen35_vl")  # Qwen3.5's engine decodes by full forwards
        if decoded is not None:
            assert decoded["cached"][0] == decoded["full"][0]
            diff = max(abs(a - b) for x, y in zip(decoded["cached"][1], decoded["full"][1]) for a, b in zip(x, y))
            assert diff < 1e-5, f"pp2 KV-cache decoding vs full forwards: {diff:.2e}"
    for stream in streams:
        assert all(torch.equal(tensor, source[name]) for name, tensor in stream.items())
    for rank_results in ranks:
        trained, resumed = rank_results["pp2"]["trained"], rank_results["pp2"]["resumed"]
        assert sorted(resumed) == sorted(trained) and all(torch.equal(resumed[k], trained[k]) for k in trained)
    for rank_results in ranks:
        for name, got in rank_results.items():
            assert (got["logprobs"] - ref["logprobs"])[mask].abs().max() < 1e-5, name
            assert got["loss_2"] == pytest.approx(ref["loss_1"], rel=1e-5), name
            err = max_rel_err(got["grad_2"], ref["grad_1"])
            assert err < 1e-5, f"{name}: gradient relative error {err:.2e}"
            vision = {k: v for k, v in ref["grad_1"].items() if k.startswith("visual.")}
            assert max_rel_err(got["grad_2"], vision) < 1e-5, f"{name}: vision tower gradients"
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
