"""Policy losses, off-policy correction, KL estimators and the critic loss against per-token loop references."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support.alg_helpers import random_batch

from megatron_rl.algorithms import (
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    LossContext,
    apply_kl_to_rewards,
    get_policy_loss,
    kl_penalty,
    policy_loss_fn,
    value_loss_fn,
)
from megatron_rl.config import AlgorithmConfig
from megatron_rl.metrics import finalize_metrics

CFG = dict(eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0)


def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.clamp(x, low, high)


def _token_loss_ref(kind: str, lp: torch.Tensor, old: float, a: float) -> torch.Tensor:
    """Per-token loss of one valid token (0-d tensors, autograd through ``lp``)."""
    r = torch.exp(lp - old)
    ppo = torch.maximum(-a * r, -a * _clip(r, 0.8, 1.28))
    if kind == "regular":
        return ppo
    if kind == "dual_clip":
        return torch.minimum(ppo, torch.tensor(-a * 3.0)) if a < 0 else ppo
    if kind == "cispo":
        return -a * _clip(r, 0.8, 1.28).detach() * lp
    if kind == "cross_entropy":
        return -a * lp
    assert kind == "importance_sampling"
    return -a * r


def _valid(mask: torch.Tensor):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]


def _loss_and_grad(fn, logprobs: torch.Tensor):
    lp = logprobs.clone().requires_grad_(True)
    loss = fn(lp)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def _ref_sum(kind: str, b: dict, lp: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(())
    for i, t in _valid(b["loss_mask"]):
        total = total + _token_loss_ref(kind, lp[i, t], float(b["old_logprobs"][i, t]), float(b["advantages"][i, t]))
    return total


@pytest.mark.parametrize("kind", ["regular", "dual_clip", "cispo", "cross_entropy", "importance_sampling"])
def test_token_losses_match_loop(kind):
    b = random_batch(0)
    cfg = AlgorithmConfig(policy_loss_type=kind, **CFG)
    fn = get_policy_loss(kind)
    loss, grad = _loss_and_grad(lambda lp: fn(lp, b["old_logprobs"], b["advantages"], b["loss_mask"], cfg)[0],
                                b["logprobs"])
    ref_loss, ref_grad = _loss_and_grad(lambda lp: _ref_sum(kind, b, lp), b["logprobs"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_regular_clipfrac_metric_matches_loop():
    b = random_batch(1)
    cfg = AlgorithmConfig(**CFG)
    _, metrics = get_policy_loss("regular")(b["logprobs"], b["old_logprobs"], b["advantages"], b["loss_mask"], cfg)
    clipped = []
    for i, t in _valid(b["loss_mask"]):
        r = math.exp(float(b["logprobs"][i, t] - b["old_logprobs"][i, t]))
        a = float(b["advantages"][i, t])
        clipped.append(float(-a * min(max(r, 0.8), 1.28) > -a * r))
    assert abs(finalize_metrics(metrics)["policy/clipfrac"] - sum(clipped) / len(clipped)) < 1e-6
    assert metrics["policy/clipfrac"].count == len(clipped)


def test_gspo_matches_sequence_level_reference():
    b = random_batch(2)
    mask = b["loss_mask"]
    row_adv = torch.randn(mask.shape[0])
    adv = row_adv[:, None] * mask  # outcome advantages: one scalar per sequence
    cfg = AlgorithmConfig(**CFG)

    def ref(lp):  # GSPO: sequence ratio with gradient, clipped per sequence, weighted by its token count
        total = torch.zeros(())
        for i in range(mask.shape[0]):
            ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
            if not ts:
                continue
            s = torch.exp(sum(lp[i, t] - float(b["old_logprobs"][i, t]) for t in ts) / len(ts))
            a = float(row_adv[i])
            total = total + len(ts) * torch.maximum(-a * s, -a * _clip(s, 0.8, 1.28))
        return total

    gspo = get_policy_loss("gspo")
    loss, grad = _loss_and_grad(lambda lp: gspo(lp, b["old_logprobs"], adv, mask, cfg)[0], b["logprobs"])
    ref_loss, ref_grad = _loss_and_grad(ref, b["logprobs"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis"])
def test_truncated_importance_sampling_matches_loop(mode):
    b = random_batch(3)
    mask = b["loss_mask"]
    cfg = AlgorithmConfig(off_policy_correction=mode, tis_cap=1.5, **CFG)
    fn = get_policy_loss("regular")
    loss, metrics = fn(b["logprobs"], b["old_logprobs"], b["advantages"], mask, cfg, b["rollout_logprobs"])
    weights, raws = {}, []
    for i in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        logs = [float(b["old_logprobs"][i, t] - b["rollout_logprobs"][i, t]) for t in ts]
        if mode == "sequence_tis":
            raw = [math.exp(sum(logs))] * len(ts)
            raws += raw[:1]
        else:
            raw = [math.exp(x) for x in logs]
            raws += raw
        weights.update({(i, t): min(w, 1.5) for t, w in zip(ts, raw)})
    ref = sum(weights[(i, t)] * float(_token_loss_ref("regular", b["logprobs"][i, t],
                                                      float(b["old_logprobs"][i, t]), float(b["advantages"][i, t])))
              for i, t in _valid(mask))
    assert abs(float(loss) - ref) < 1e-4
    final = finalize_metrics(metrics)
    assert abs(final["off_policy/tis_ratio_mean"] - sum(raws) / len(raws)) < 1e-4 * max(raws)
    assert abs(final["off_policy/tis_ratio_max"] - max(raws)) < 1e-4 * max(raws)
    assert abs(final["off_policy/tis_clipfrac"] - sum(r > 1.5 for r in raws) / len(raws)) < 1e-6


def _kl_ref(kind: str, x: float) -> float:
    return {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1.0, "abs": abs(x)}[kind]


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS))
def test_kl_estimators_match_formula_and_are_nan_free(kind):
    b = random_batch(4)
    mask = b["loss_mask"]
    lp = b["logprobs"].clone().requires_grad_(True)
    kl = kl_penalty(lp, b["ref_logprobs"], mask, kind)  # ref_logprobs is NaN on masked positions
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                expected = _kl_ref(kind, float(b["logprobs"][i, t] - b["ref_logprobs"][i, t]))
                assert abs(float(kl[i, t].detach()) - expected) < 1e-5
            else:
                assert kl[i, t] == 0 and lp.grad[i, t] == 0
    with pytest.raises(ValueError, match="kl_estimator_type"):
        kl_penalty(lp, b["ref_logprobs"], mask, "k9")


def test_kl_k3_is_clamped():
    mask = torch.ones(1, 2)
    kl = kl_penalty(torch.tensor([[-50.0, 0.0]]), torch.tensor([[0.0, -50.0]]), mask, "k3")
    assert torch.isfinite(kl).all() and float(kl.max()) <= 10.0


def test_apply_kl_to_rewards():
    b = random_batch(5)
    mask = b["loss_mask"]  # the logprobs hold garbage (-inf / nan) wherever this mask is 0
    rewards = torch.randn(mask.shape)
    new, metrics = apply_kl_to_rewards(rewards, b["old_logprobs"], b["ref_logprobs"], mask, 0.1, "k1")
    valid = mask > 0
    expected = rewards - 0.1 * (b["old_logprobs"] - b["ref_logprobs"])
    torch.testing.assert_close(new[valid], expected[valid])
    torch.testing.assert_close(new[~valid], rewards[~valid])
    assert torch.isfinite(new).all()
    assert metrics["kl_in_reward/kl"].count == float(valid.sum())


def test_value_loss_matches_loop():
    b = random_batch(6)
    mask = b["loss_mask"]
    g = torch.Generator().manual_seed(0)
    returns, old_values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    cfg = AlgorithmConfig(value_clip=0.3, loss_reduction="sequence_mean")
    ctx = LossContext.for_minibatch(cfg, mask)
    mb = {"loss_mask": mask, "returns": returns, "values": old_values}
    new_values = old_values + torch.randn(mask.shape, generator=g)
    loss, _ = value_loss_fn(new_values, None, mb, ctx)
    ref = 0.0
    for i, t in _valid(mask):
        v, old, ret = float(new_values[i, t]), float(old_values[i, t]), float(returns[i, t])
        v_clip = old + min(max(v - old, -0.3), 0.3)
        ref += 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2) / (mask.shape[0] * float(mask[i].sum()))
    assert abs(float(loss) - ref) < 1e-5


@pytest.mark.parametrize("mode", [m for m in OFF_POLICY_CORRECTIONS if m != "none"])
@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_all_masked_rows_and_minibatch_are_nan_free(kind, mode):
    b = random_batch(7)
    cfg = AlgorithmConfig(policy_loss_type=kind, use_kl_loss=True, entropy_loss_coef=0.01,
                          off_policy_correction=mode, **CFG)
    for mask in (b["loss_mask"], torch.zeros_like(b["loss_mask"])):  # one empty row; then everything masked
        mb = {**b, "loss_mask": mask}
        lp = b["logprobs"].clone().requires_grad_(True)
        ent = b["entropy"].clone().requires_grad_(True)
        loss, metrics = policy_loss_fn(lp, ent, mb, LossContext.for_minibatch(cfg, mask))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
        assert all(math.isfinite(v) for v in finalize_metrics(metrics).values())
        assert torch.all(lp.grad[mask == 0] == 0) and torch.all(ent.grad[mask == 0] == 0)
        if mask.sum() == 0:
            assert float(loss.detach()) == 0.0


def test_policy_loss_fn_errors():
    b = random_batch(8)
    ctx_args = dict(minibatch_loss_tokens=float(b["loss_mask"].sum()))
    with pytest.raises(ValueError, match="valid:.*regular"):
        policy_loss_fn(b["logprobs"], None, b, LossContext(config=AlgorithmConfig(policy_loss_type="x"), **ctx_args))
    no_ref = {k: v for k, v in b.items() if k != "ref_logprobs"}
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss_fn(b["logprobs"], None, no_ref, LossContext(config=AlgorithmConfig(use_kl_loss=True), **ctx_args))
    with pytest.raises(ValueError, match="compute_entropy"):
        policy_loss_fn(b["logprobs"], None, b, LossContext(config=AlgorithmConfig(entropy_loss_coef=0.1), **ctx_args))
    no_rollout = {k: v for k, v in b.items() if k != "rollout_logprobs"}
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss_fn(b["logprobs"], None, no_rollout,
                       LossContext(config=AlgorithmConfig(off_policy_correction="token_tis"), **ctx_args))
    with pytest.raises(ValueError, match="minibatch_num_sequences"):
        value_loss_fn(b["logprobs"], None, {**b, "returns": b["advantages"], "values": b["advantages"]},
                      LossContext(config=AlgorithmConfig(), **ctx_args))


def test_on_policy_default_old_logprobs():
    b = random_batch(9)
    mb = {k: v for k, v in b.items() if k != "old_logprobs"}
    ctx = LossContext.for_minibatch(AlgorithmConfig(), b["loss_mask"])
    lp = b["logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss_fn(lp, None, mb, ctx)
    loss.backward()
    # ratio = 1 at the current policy: loss = -sum(A), gradient = -A on loss tokens
    torch.testing.assert_close(loss.detach(), -(b["advantages"] * b["loss_mask"]).sum())
    torch.testing.assert_close(lp.grad, -b["advantages"] * b["loss_mask"])
    assert abs(finalize_metrics(metrics)["policy/ratio_mean"] - 1.0) < 1e-6


def test_duplicate_policy_loss_name_is_a_value_error():
    """A ValueError, not an assert: under ``python -O`` an assert would let a loss be silently replaced."""
    from megatron_rl.algorithms.losses import POLICY_LOSSES, register_policy_loss

    name = sorted(POLICY_LOSSES)[0]
    original = POLICY_LOSSES[name]
    with pytest.raises(ValueError, match=f"{name!r} is already registered"):
        register_policy_loss(name)(lambda *args, **kwargs: None)
    assert POLICY_LOSSES[name] is original
