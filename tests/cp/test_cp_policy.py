"""MegatronPolicy under context parallelism (gloo, CPU, fp32) against the single process (issue 13).

Three spawns, module-scoped and shared by the tests:

  reference (1 rank, CP1)   weights, forward log-probs/entropy, next-token log-probs, gradients of the global
                            summed loss for 1, 2 and 4 micro-batches, and the log-probs of a planted batch
  cp2 (2 ranks)             the same under CP2, plus: the scale ablations (the cp factor dropped / added must
                            break gradient invariance), the leak probe (a planted change in one sequence leaves
                            the other rows bitwise unchanged), and an all-masked micro-batch (zero gradient)
  4 ranks, 3 layouts        CP2xDP2, CP2xTP2 (+ sequence parallel), CP2xPP2: forward and gradients

Tolerances: log-probs max |d| < 1e-5 and gradients relative < 1e-5 (the issue's bounds; fp32, the differences
are summation order only: ~1e-7 measured).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_helpers import batch_tensors, fresh_policy, grad_of, init, make_batch, make_config, max_rel_err
from tests.support.multirank import run_ranks
from tests.support.reference import reference_fixtures

pytestmark = pytest.mark.multirank

MB_COUNTS = (1, 2, 4)
PLANTED_ROW = 3  # a sequence whose tokens change in the leak probe


def _planted(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same batch with every valid token of row PLANTED_ROW changed (lengths unchanged)."""
    planted = {k: v.clone() for k, v in tensors.items()}
    row, valid = planted["sequences"][PLANTED_ROW], planted["attention_mask"][PLANTED_ROW].bool()
    row[valid] = (row[valid] + 7) % 63 + 1
    return planted


def _outputs(policy, tensors, groups) -> dict:
    batch = make_batch(tensors)
    policy.config.batch.micro_batch_size = 4  # rows of very different lengths share a pack
    out = {"forward": {k: v.cpu() for k, v in policy.forward(batch, compute_entropy=True).items()}}
    out["planted"] = policy.forward(make_batch(_planted(tensors)))["logprobs"].cpu()
    out["next_token"] = policy.next_token_logprobs(tensors["sequences"], tensors["attention_mask"])
    for count in MB_COUNTS:
        out[f"grad_{count}"] = grad_of(policy, batch, groups.dp_size, count)
    return out


def _reference_rank(rank, world_size, tensors):
    cfg = make_config()
    groups = init(cfg)
    policy = fresh_policy(cfg, groups)
    out = {"full_sd": {k: v.clone() for k, v in policy.full_state_dict().items()}}
    out.update(_outputs(policy, tensors, groups))
    return out


def _cp2_rank(rank, world_size, tensors, full_sd):
    from megatron_rl.model import scaling

    cfg = make_config(cp=2)
    groups = init(cfg)
    policy = fresh_policy(cfg, groups, full_sd)
    out = {"cp": (groups.cp_size, groups.cp_rank, groups.dp_size)}
    out.update(_outputs(policy, tensors, groups))
    batch = make_batch(tensors)
    original = scaling.megatron_loss_scale
    for name, fake in {"drop_cp": lambda n, d: n * d / 2, "add_cp": lambda n, d: n * d * 2}.items():
        scaling.megatron_loss_scale = fake
        try:
            out[f"ablation_{name}"] = grad_of(policy, batch, groups.dp_size, 2)
        finally:
            scaling.megatron_loss_scale = original
    masked = {k: v.clone() for k, v in tensors.items()}
    masked["loss_mask"].zero_()
    out["masked_grad"] = grad_of(policy, make_batch(masked), groups.dp_size, 2)
    return out


LAYOUTS = {  # name: (tp, pp, cp, micro-batch counts, sequence parallel variant)
    "cp2xdp2": (1, 1, 2, MB_COUNTS, False),
    "cp2xtp2": (2, 1, 2, MB_COUNTS, True),
    "cp2xpp2": (1, 2, 2, (2,), False),
}


def _four_rank(rank, world_size, tensors, full_sd):
    out = {}
    for name, (tp, pp, cp, counts, sp) in LAYOUTS.items():
        cfg = make_config(tp, pp, cp)
        groups = init(cfg)
        policy = fresh_policy(cfg, groups, full_sd)
        batch = make_batch(tensors)
        policy.config.batch.micro_batch_size = 4
        res = {"forward": policy.forward(batch, compute_entropy=True)}
        for count in counts:
            res[f"grad_{count}"] = grad_of(policy, batch, groups.dp_size, count)
        if sp:
            sp_policy = fresh_policy(make_config(tp, pp, cp, sequence_parallel=True), groups, full_sd)
            sp_policy.config.batch.micro_batch_size = 4
            res["sp_forward"] = sp_policy.forward(batch)["logprobs"]
            res["sp_grad_2"] = grad_of(sp_policy, batch, groups.dp_size, 2)
        out[name] = res
    return out


tensors, reference = reference_fixtures(batch_tensors, _reference_rank, timeout=300)


@pytest.fixture(scope="module")
def cp2(tensors, reference):
    return run_ranks(2, _cp2_rank, tensors, reference["full_sd"], timeout=600)


@pytest.fixture(scope="module")
def four(tensors, reference):
    return run_ranks(4, _four_rank, tensors, reference["full_sd"], timeout=900)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_cp2_logprobs_and_entropy_match_cp1(tensors, reference, cp2):
    assert [r["cp"] for r in cp2] == [(2, 0, 1), (2, 1, 1)]
    for res in cp2:  # every rank returns the whole [B, R]
        for name in ("logprobs", "entropy"):
            assert res["forward"][name].shape == reference["forward"][name].shape
            assert _max_abs(res["forward"][name], reference["forward"][name]) < 1e-5, name
        assert _max_abs(res["next_token"], reference["next_token"]) < 1e-5
    # rows shorter than 2*cp tokens (2 and 3 tokens) have real values
    assert reference["forward"]["logprobs"][:2].abs().sum() > 0


def test_cp2_gradient_matches_single_process(reference, cp2):
    for count in MB_COUNTS:
        for res in cp2:
            assert max_rel_err(res[f"grad_{count}"], reference[f"grad_{count}"]) < 1e-5, count


def test_dropping_or_adding_the_cp_factor_breaks_invariance(reference, cp2):
    for name in ("drop_cp", "add_cp"):
        assert max_rel_err(cp2[0][f"ablation_{name}"], reference["grad_2"]) > 0.4, name


def test_no_token_leaks_across_sequences_or_cp_chunks(tensors, reference, cp2):
    """A change in one sequence leaves every other row's log-probs bitwise unchanged (CP2, both ranks)."""
    others = [i for i in range(tensors["sequences"].shape[0]) if i != PLANTED_ROW]
    for res in cp2:
        base, planted = res["forward"]["logprobs"], res["planted"]
        assert torch.equal(base[others], planted[others])
        assert not torch.equal(base[PLANTED_ROW], planted[PLANTED_ROW])  # the probe does change something
    assert _max_abs(cp2[0]["planted"], reference["planted"]) < 1e-5


def test_all_masked_micro_batch_under_cp_gives_zero_gradient(cp2):
    for res in cp2:
        grads = res["masked_grad"]
        assert all(torch.isfinite(g).all() for g in grads.values())
        assert max(float(g.abs().max()) for g in grads.values()) == 0.0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_four_rank_layouts_match_single_process(reference, four, layout):
    counts = LAYOUTS[layout][3]
    for res in (r[layout] for r in four):
        for name in ("logprobs", "entropy"):
            assert _max_abs(res["forward"][name], reference["forward"][name]) < 1e-5, name
        for count in counts:
            assert max_rel_err(res[f"grad_{count}"], reference[f"grad_{count}"]) < 1e-5, count
        if "sp_forward" in res:
            assert _max_abs(res["sp_forward"], reference["forward"]["logprobs"]) < 1e-5
            assert max_rel_err(res["sp_grad_2"], reference["grad_2"]) < 1e-5
