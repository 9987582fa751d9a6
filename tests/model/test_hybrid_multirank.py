"""A hybrid Gated-DeltaNet (Qwen3.5-shaped) policy: the step's loss, gradients and grad norm do not depend on
micro-batching, DP, TP (+ sequence parallelism) or PP.

Reference: the single-process ``MegatronPolicy`` of the same weights with one micro-batch (in this process).
ONE 2-rank spawn runs every layout in turn (DP2, TP2 with SP, PP2), each with 2 micro-batches per rank (the
reference with 1 and 2). The same spawn checks the vLLM weight sync's per-stage stream (``hf/qwen35.py:
StageStream``): under TP2 and PP2 the stages' streams together are the full model's HF tensors, bitwise.
The helpers are those of test_policy_multirank.py (the summed policy-gradient loss, its batch of 7 uneven
rows). Tolerances as there: fp32 with a different reduction order (relative 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.batches import max_rel_err, steps_per_count, training_batch
from megatron_rl.model import hybrid
from tests.support.multirank import run_ranks
from tests.model.test_policy_multirank import LR, _batch_tensors, _fresh_policy, summed_pg_loss

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not hybrid.mcore_supports_hybrid(),
                       reason=f"hybrid Gated-DeltaNet models need megatron-core>={hybrid.MIN_MCORE} "
                              "(docs/MEGATRON_CORE.md)"),
]

LAYOUTS = {"dp2": dict(), "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "pp2": dict(pipeline_model_parallel_size=2)}
COUNTS = (1, 2)
"""Micro-batches per rank: the reference runs both, each layout 2 (CPU time: each is a forward-backward)."""
LAYOUT_COUNTS = (2,)


def _config(**parallel):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    model = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        kv_channels=32, vocab_size=128, qk_layernorm=True, linear_attention_freq=[1, 0, 1, 0],
                        attention_output_gate=True, rotary_percent=0.25, layernorm_zero_centered_gamma=True,
                        attention_backend="local")
    return MegatronRLConfig(parallel=ParallelConfig(**parallel), model=model,
                            optimizer=OptimizerConfig(optimizer="sgd", lr=LR, clip_grad=1e6), seed=1234)


def _runs(cfg, groups, tensors, full_sd, counts) -> dict:
    """Loss and finalized gradients per micro-batch count, then the grad norm of one optimizer step."""
    from megatron_rl.hf.qwen35 import StageStream

    batch = training_batch(tensors)
    policy = _fresh_policy(cfg, groups, full_sd)
    out = {"stream": dict(StageStream(cfg.model).iter_stage_weights([policy.module], groups))}
    return {**out, **steps_per_count(policy, batch, groups, counts, summed_pg_loss)}


def _layouts_rank(rank, world_size, tensors, full_sd):
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    results = {}
    for name, parallel in LAYOUTS.items():
        cfg = _config(**parallel)
        groups = initialize_distributed(cfg.parallel, cfg.seed)
        try:
            results[name] = _runs(cfg, groups, tensors, full_sd, LAYOUT_COUNTS)
        finally:
            destroy_distributed(keep_process_group=True)  # the next layout reuses the process group
    return results


@pytest.fixture(scope="module")
def reference():
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    cfg, tensors = _config(), _batch_tensors()
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    try:
        full_sd = {k: v.clone() for k, v in MegatronPolicy(cfg, groups).full_state_dict().items()}
        return tensors, full_sd, _runs(cfg, groups, tensors, full_sd, COUNTS)
    finally:
        destroy_distributed()


def test_loss_grads_and_grad_norm_independent_of_micro_batching_and_layout(reference):
    tensors, full_sd, ref = reference
    assert ref["loss_1"] != 0.0 and any(".in_proj." in k for k in ref["grad_1"])
    assert max_rel_err(ref["grad_2"], ref["grad_1"]) < 1e-5
    from megatron_rl.hf.qwen35 import megatron_to_hf

    want = megatron_to_hf(full_sd, _config().model)
    streamed = {name: {} for name in LAYOUTS}
    for rank_results in run_ranks(2, _layouts_rank, tensors, full_sd, timeout=600):
        for name, got in rank_results.items():
            if name == "dp2":  # every DP rank is a TP rank 0 of the only stage (the weight sync sends from dp 0)
                streamed[name] = got["stream"]
            else:
                assert not streamed[name].keys() & got["stream"].keys(), f"{name}: a tensor streamed twice"
                streamed[name].update(got["stream"])
            for count in LAYOUT_COUNTS:
                assert got[f"loss_{count}"] == pytest.approx(ref["loss_1"], rel=1e-5), (name, count)
                err = max_rel_err(got[f"grad_{count}"], ref["grad_1"])
                assert err < 1e-5, f"{name}, {count} micro-batches: gradient relative error {err:.2e}"
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
    for name, stream in streamed.items():  # the vLLM weight sync's stream: TP-gathered, each stage its own layers
        assert stream.keys() == want.keys(), name
        assert all(torch.equal(stream[k], want[k]) for k in want), f"{name}: the weight-sync stream is not bitwise"
