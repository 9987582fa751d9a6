"""MoE gradient invariance: policy loss + load-balancing loss + z-loss under EP2, EP2xDP2, EP2xTP2 (sequence
parallel), EP2xPP2, TP2, CP2 and 1/2/4 micro-batches equals the single-process gradient (docs/MOE.md section 3).

The reference is one process (EP1) with one micro-batch; it also checks that its own gradient does not depend on
the micro-batch count and that the auxiliary terms move the gradient well beyond the tolerance (so the test
would see them mis-scaled). Each layout runs in one spawn that loads the reference weights. Planted bug: the aux
gradient scale set to 1 (DDP's mean over DP left in) must fail by more than 10x the tolerance.

(TP2, where dp * cp = 1: the expert counts not all-reduced over the TP ranks.)
Tolerance 1e-5 relative (L2 over all parameters), as for the dense layouts (tests/model/test_policy_multirank.py):
fp32 sums in a different order (packing, all-to-all, DDP buckets) differ at ~1e-7 relative.
"""

from __future__ import annotations


import pytest
import torch

from tests.support.batches import (full_grads, left_padded_tensors, max_rel_err, micro_batch_size, summed_pg_loss,
                     training_batch)
from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture, reference_fixtures

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

PROMPT_LENS = [3, 9, 2, 5, 12, 4, 6]
RESPONSE_LENS = [6, 2, 11, 4, 1, 8, 5]  # 7 rows: DP2 and DP4 add a dummy row, which is no sequence of the losses
MB_COUNTS = (1, 2, 4)
TOLERANCE = 1e-5


def moe_config(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, *, sequence_parallel: bool = False,
               aux: float = 0.1, z: float | None = 0.01):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                context_parallel_size=cp, expert_model_parallel_size=ep,
                                sequence_parallel=sequence_parallel),
        model=ModelConfig(attention_backend="local", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                          moe_aux_loss_coeff=aux, moe_z_loss_coeff=z),
        optimizer=OptimizerConfig(optimizer="sgd", lr=0.05),
        seed=1234,
    )


def _tensors():
    g = torch.Generator().manual_seed(0)
    return left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, 128, g, loss_drop=0.2, advantages=True)


def _grads(policy, batch, dp_size: int, count: int) -> tuple[dict, dict]:
    policy.config.batch.micro_batch_size = micro_batch_size(len(batch), dp_size, count)
    metrics = policy.forward_backward(batch, summed_pg_loss, None)
    policy.finalize_grads()
    grads = full_grads(policy)
    policy.zero_grad()
    return grads, {k: m.final() for k, m in metrics.items()}


def _reference_rank(rank, world_size, tensors):
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    cfg = moe_config()
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    batch = training_batch(tensors)
    out = {"full_sd": {k: v.clone() for k, v in policy.full_state_dict().items()}}
    for count in MB_COUNTS:
        out[f"grad_{count}"], out[f"metrics_{count}"] = _grads(policy, batch, 1, count)
    plain = MegatronPolicy(moe_config(aux=0.0, z=None), groups)
    plain.load_full_state_dict(out["full_sd"])
    out["grad_no_aux"], _ = _grads(plain, batch, 1, 1)
    return out


def _layout_rank(rank, world_size, layout, tensors, full_sd):
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model import moe
    from megatron_rl.model.policy import MegatronPolicy

    cfg = moe_config(**layout)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    policy.load_full_state_dict(full_sd)
    batch = training_batch(tensors)
    out = {"dp": groups.dp_size, "ep": groups.ep_size}
    for count in MB_COUNTS:
        out[f"grad_{count}"], out[f"metrics_{count}"] = _grads(policy, batch, groups.dp_size, count)
    original = moe.call_tokens

    def unscaled(*args, **kwargs):
        """Planted bug: DDP's mean over DP x CP is not cancelled; where dp * cp = 1 (TP2), the expert counts of a
        sequence are not summed over the ranks holding its tokens instead."""
        tokens = original(*args, **kwargs)
        if tokens.grad_scale > 1:
            tokens.grad_scale = 1.0
        else:
            tokens.count_group = None
        return tokens

    moe.call_tokens = unscaled
    try:
        out["grad_planted"], _ = _grads(policy, batch, groups.dp_size, 2)
    finally:
        moe.call_tokens = original
    return out


LAYOUTS = {  # name: (world size, parallel sizes); expert_tensor_parallel_size is 1 (CPU)
    "ep2": (2, {"ep": 2}),
    "tp2": (2, {"tp": 2, "sequence_parallel": True}),  # each TP rank routes its half of the tokens
    "cp2": (2, {"cp": 2}),  # expert counts of a sequence summed over its CP halves
    "ep2xdp2": (4, {"ep": 2}),
    "ep2xtp2": (4, {"ep": 2, "tp": 2, "sequence_parallel": True}),
    "ep2xpp2": (4, {"ep": 2, "pp": 2}),
}


def _run_layout(name, tensors, reference):
    world, layout = LAYOUTS[name]
    return run_ranks(world, _layout_rank, layout, tensors, reference["full_sd"], timeout=900)


tensors, reference = reference_fixtures(_tensors, _reference_rank, timeout=300)
layout_results = layout_fixture(_run_layout)




def test_reference_gradient_independent_of_micro_batches_and_aux_matters(reference):
    for count in MB_COUNTS[1:]:
        assert max_rel_err(reference[f"grad_{count}"], reference["grad_1"]) < TOLERANCE
    # The auxiliary terms change the gradient far beyond the tolerance, so a mis-scaled term cannot hide.
    assert max_rel_err(reference["grad_no_aux"], reference["grad_1"]) > 100 * TOLERANCE
    experts = [k for k in reference["full_sd"] if ".mlp.experts.local_experts." in k]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2): every expert is in the full dict
    metrics = reference["metrics_1"]
    assert metrics["moe/load_balancing_loss"] > 0 and metrics["moe/z_loss"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_gradient_invariance(layout, layout_results, reference):
    results = layout_results(layout)
    assert results[0]["ep"] == LAYOUTS[layout][1].get("ep", 1)
    for rank_out in results:
        for count in MB_COUNTS:
            err = max_rel_err(rank_out[f"grad_{count}"], reference["grad_1"])
            assert err < TOLERANCE, f"{layout} {count} micro-batches: relative error {err:.2e}"
            for name in ("moe/load_balancing_loss", "moe/z_loss"):
                got, want = rank_out[f"metrics_{count}"][name], reference["metrics_1"][name]
                assert got == pytest.approx(want, rel=1e-5), (layout, count, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planted_aux_scaling_bug_fails(layout, layout_results, reference):
    for rank_out in layout_results(layout):
        assert max_rel_err(rank_out["grad_planted"], reference["grad_1"]) > 10 * TOLERANCE, layout
