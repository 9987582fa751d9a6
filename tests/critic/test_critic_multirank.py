"""MegatronCritic (value head) under TP2 (+SP), PP2 and DP2 (gloo) against single-process references.

The 1-rank spawn builds the reference: the full weights of a critic, its values from a plain GPTModel with the
value head (one unpacked forward per row, placed right-aligned by hand: column k = V of the state before
response token k), and the plain-autograd gradient of the summed clipped value loss of the whole batch
(``value_loss_fn``, one LossContext for the batch). It also checks a save / step / resume round trip of policy +
critic (``save_with_critic`` / ``load_with_critic``): the resumed step is bitwise the uninterrupted one. Each
layout loads the same weights and returns its values and finalized gradients for several micro-batch counts
and a token budget (the scaling contract: they must not depend on the split).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.batches import full_grads as _full_grads, left_padded_tensors, training_batch as _batch
from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture, reference_fixtures

pytestmark = pytest.mark.slow  # spawns ranks

PROMPT_LENS = [3, 9, 2, 5, 12, 4, 6]
RESPONSE_LENS = [6, 2, 11, 4, 1, 8, 5]  # uneven; B=7 is odd, so DP2 adds a dummy row
MB_COUNTS = (1, 2, 4)


def _config(tp: int = 1, pp: int = 1, *, sequence_parallel: bool = False, cp: int = 1):
    from megatron_rl.config import (AlgorithmConfig, CriticConfig, MegatronRLConfig, ModelConfig, OptimizerConfig,
                                    ParallelConfig)

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                sequence_parallel=sequence_parallel, context_parallel_size=cp),
        model=ModelConfig(attention_backend="local"),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0),
        algorithm=AlgorithmConfig(advantage_estimator="gae", value_clip=0.05, loss_reduction="sequence_mean"),
        critic=CriticConfig(lr=0.01),
        seed=1234,
    )


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, 128, g, loss_drop=0.2)
    t["loss_mask"][1] = 0.0  # a row with no loss token
    t["values"] = torch.randn(t["loss_mask"].shape, generator=g) * 0.02  # old values: the clip bites
    t["returns"] = torch.randn(t["loss_mask"].shape, generator=g)
    return t


def _ctx(cfg, tensors):
    from megatron_rl.algorithms.losses import LossContext

    return LossContext.for_minibatch(cfg.algorithm, tensors["loss_mask"])


def _critic(cfg, groups, full_sd):
    from megatron_rl.model.critic import MegatronCritic

    critic = MegatronCritic(cfg, groups)
    critic.load_full_state_dict(full_sd)
    return critic


def _grad_runs(critic, cfg, tensors, dp_size: int, counts) -> dict:
    from megatron_rl.algorithms.losses import value_loss_fn

    batch, out = _batch(tensors), {}
    for count in counts:
        shard = -(-len(batch) // dp_size)
        critic.config.batch.micro_batch_size = -(-shard // count)
        out[f"metrics_{count}"] = {k: m.final() for k, m in
                                   critic.forward_backward(batch, value_loss_fn, _ctx(cfg, tensors)).items()}
        critic.finalize_grads()
        out[f"grad_{count}"] = _full_grads(critic)
        critic.zero_grad()
    critic.config.batch.micro_batch_size = None
    critic.config.batch.max_tokens_per_micro_batch = 22  # packs of different lengths; DP2: a dummy micro-batch
    critic.forward_backward(batch, value_loss_fn, _ctx(cfg, tensors))
    critic.finalize_grads()
    out["grad_budget"] = _full_grads(critic)
    critic.zero_grad()
    critic.config.batch.max_tokens_per_micro_batch = None
    critic.config.batch.micro_batch_size = 4
    return out


# ---------------------------------------------------------------------- the reference (1 rank)


def _row_values(model, tensors) -> torch.Tensor:
    """[B, R] values, one plain (unpacked, causal) forward per row: the output at position j is the value of
    the state ending with token j, i.e. before token j+1, so it belongs to the column of token j+1."""
    seqs, am = tensors["sequences"], tensors["attention_mask"]
    width, resp_width = seqs.shape[1], tensors["response_mask"].shape[1]
    rows = []
    for i in range(seqs.shape[0]):
        tokens = seqs[i][am[i].bool()][None]  # [1, n]
        n = tokens.shape[1]
        v = model(tokens, torch.arange(n)[None], None)[0, :-1, 0].float()  # [n-1]: before tokens 1..n-1
        full = torch.cat([torch.zeros(width - n), v, torch.zeros(1)])  # column c holds V before token c+1
        rows.append(full[width - resp_width - 1: width - 1])
    return torch.stack(rows)


def _reference_rank(rank, world_size, tensors):
    from megatron_rl.algorithms.losses import value_loss_fn
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.critic import MegatronCritic, build_value_model, critic_config
    from megatron_rl.model.weights import load_full_state_dict

    cfg = _config()
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    critic = MegatronCritic(cfg, groups)
    full_sd = {k: v.clone() for k, v in critic.full_state_dict().items()}
    plain = build_value_model(critic_config(cfg), groups)
    load_full_state_dict(plain, full_sd, groups)
    values = _row_values(plain, tensors)
    loss, _ = value_loss_fn(values, None, tensors, _ctx(cfg, tensors))
    loss.backward()
    out = {
        "full_sd": full_sd,
        "values": values.detach(),
        "loss": float(loss),
        "grads": {k: p.grad.clone() for k, p in plain.named_parameters()},
        "forward": critic.forward(_batch(tensors))["values"],
        "head_keys": sorted(k for k in full_sd if k.startswith("output_layer.")),
    }
    out.update(_grad_runs(_critic(cfg, groups, full_sd), cfg, tensors, 1, MB_COUNTS))
    out["resume"] = _resume_roundtrip(cfg, groups, tensors, full_sd)
    out["no_values"] = _missing_values_error(critic, tensors)
    return out


def _missing_values_error(critic, tensors) -> str:
    from megatron_rl.algorithms.losses import value_loss_fn

    cfg = _config()
    bad = {k: v for k, v in tensors.items() if k != "values"}
    try:
        critic.forward_backward(_batch(bad), value_loss_fn, _ctx(cfg, tensors))
        return "no error"
    except ValueError as err:
        return str(err)


def _resume_roundtrip(cfg, groups, tensors, full_sd) -> dict:
    """Policy + critic: save, two steps (the uninterrupted run); resume from the save, the same two steps."""
    import tempfile

    from megatron_rl.algorithms.losses import policy_loss_fn, value_loss_fn
    from megatron_rl.checkpoint import load_with_critic, save_with_critic
    from megatron_rl.model.policy import MegatronPolicy

    t = dict(tensors, advantages=tensors["returns"], old_logprobs=torch.zeros_like(tensors["returns"]))
    batch = _batch(t)

    def steps(policy, critic):
        for _ in range(2):
            policy.forward_backward(batch, policy_loss_fn, _ctx(cfg, t))
            policy.optim_step()
            critic.forward_backward(batch, value_loss_fn, _ctx(cfg, t))
            critic.optim_step()
        return policy.full_state_dict(), critic.full_state_dict()

    policy, critic = MegatronPolicy(cfg, groups), _critic(cfg, groups, full_sd)
    steps(policy, critic)  # optimizer state worth saving (Adam moments, LR schedule position)
    with tempfile.TemporaryDirectory() as tmp:
        save_with_critic(policy, critic, tmp, {"step": 5})
        straight = steps(policy, critic)
        policy2, critic2 = MegatronPolicy(cfg, groups), _fresh_critic(cfg, groups)
        state = load_with_critic(policy2, critic2, tmp)
        resumed = steps(policy2, critic2)
    same = all(torch.equal(a[k], b[k]) for a, b in zip(straight, resumed) for k in a)
    return {"step": state["step"], "bitwise": same, "critic_changed": not torch.equal(
        straight[1]["output_layer.weight"], full_sd["output_layer.weight"])}


def _fresh_critic(cfg, groups):
    """A critic with other (random) weights: the load must win."""
    from megatron_rl.model.critic import MegatronCritic

    return MegatronCritic(cfg, groups)


# ---------------------------------------------------------------------- the layouts


def _layout_rank(rank, world_size, tp, pp, tensors, full_sd, sequence_parallel, cp):
    from megatron_rl.distributed.bootstrap import initialize_distributed

    cfg = _config(tp, pp, cp=cp)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    critic = _critic(cfg, groups, full_sd)
    out = {"forward": critic.forward(_batch(tensors))["values"]}
    out.update(_grad_runs(critic, cfg, tensors, groups.dp_size, MB_COUNTS))
    if sequence_parallel:
        sp_cfg = _config(tp, pp, sequence_parallel=True)
        sp = _critic(sp_cfg, groups, full_sd)
        out["sp_forward"] = sp.forward(_batch(tensors))["values"]
        out.update({f"sp_{k}": v for k, v in _grad_runs(sp, sp_cfg, tensors, groups.dp_size, (2,)).items()})
    return out


LAYOUTS = {"tp2": (2, 1, True, 1), "pp2": (1, 2, False, 1), "dp2": (1, 1, False, 1), "cp2": (1, 1, False, 2)}
# name: (tp, pp, also SP, cp)


def _run_layout(name, tensors, reference):
    tp, pp, sp, cp = LAYOUTS[name]
    return run_ranks(2, _layout_rank, tp, pp, tensors, reference["full_sd"], sp, cp, timeout=600)


tensors, reference = reference_fixtures(_tensors, _reference_rank, timeout=400)
layout_results = layout_fixture(_run_layout)


def _max_rel_err(got: dict, ref: dict) -> float:
    assert set(ref) <= set(got), sorted(set(ref) - set(got))
    num = math.sqrt(sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref))
    den = math.sqrt(sum(float(ref[k].pow(2).sum()) for k in ref))
    return num / den


# ---------------------------------------------------------------------- tests
# Tolerances: fp32 on CPU; packing, TP reductions and pipeline order change summation order only (~1e-7
# relative), 1e-5 leaves room without hiding a wrong factor (a missing or doubled scale is >= 50%).


def test_single_process_critic_matches_plain_forward_and_autograd(reference, tensors):
    assert reference["head_keys"] == ["output_layer.bias", "output_layer.weight"]
    assert (reference["forward"] - reference["values"]).abs().max() < 1e-5
    assert reference["loss"] != 0.0
    for c in MB_COUNTS:
        err = _max_rel_err(reference[f"grad_{c}"], reference["grads"])
        assert err < 1e-5, f"{c} micro-batches: relative error {err:.2e}"
        assert reference[f"metrics_{c}"]["critic/value_loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert 0.0 < reference["metrics_1"]["critic/vf_clipfrac"] < 1.0  # both branches of the clip are exercised


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_layout_parity(layout, layout_results, reference):
    for rank_out in layout_results(layout):
        diff = (rank_out["forward"] - reference["values"]).abs().max()
        assert diff < 1e-5, f"{layout}: max |value diff| {diff:.2e}"
        if LAYOUTS[layout][2]:
            assert (rank_out["sp_forward"] - reference["values"]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_critic_gradient_invariance(layout, layout_results, reference):
    """Finalized gradient == single-process plain autograd, for every micro-batch count and a token budget."""
    for rank_out in layout_results(layout):
        keys = [f"grad_{c}" for c in MB_COUNTS] + ["grad_budget"]
        keys += ["sp_grad_2", "sp_grad_budget"] if LAYOUTS[layout][2] else []
        for key in keys:
            err = _max_rel_err(rank_out[key], reference["grads"])
            assert err < 1e-5, f"{layout} {key}: relative error {err:.2e}"
        assert rank_out["metrics_2"]["critic/value_loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_policy_and_critic_resume_bitwise(reference):
    assert reference["resume"] == {"step": 5, "bitwise": True, "critic_changed": True}


def test_critic_without_values_raises(reference):
    assert "'values'" in reference["no_values"]
