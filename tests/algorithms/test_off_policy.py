"""Off-policy corrections (``algorithms/off_policy.py``) against a plain-Python loop reference on a hand-built batch.

The batch's log-ratios ``old - rollout`` are chosen so that every mode makes a different decision somewhere: a
token above the band inside a sequence whose summed ratio is inside it, a sequence masked by its sum but kept by
its geometric mean (both ends), a sequence whose every token is outside the band, an empty row (no loss token,
garbage log-probs), a hole in a loss mask and left padding. The reference recomputes each weight from the
definition in float64; the implementation works in float32, so values agree to ~1e-6 relative (tolerance 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import LossContext, importance_ratio_metrics, off_policy_weights, policy_loss_fn
from megatron_rl.algorithms.off_policy import MASKING_CORRECTIONS, OFF_POLICY_CORRECTIONS
from megatron_rl.config import AlgorithmConfig
from megatron_rl.metrics import finalize_metrics

LOW, HIGH, CAP = 0.5, 2.0, 1.5
NAN, NEG_INF = float("nan"), float("-inf")

# Per row: the log-ratios old - rollout of its loss tokens, right-aligned (None = not a loss token).
LOG_RATIOS = [
    [None, None, 0.1, -0.2, 0.8, -0.4],   # token 0.8 (r=2.23) outside; sum 0.3 inside
    [None, None, None, -1.5, -1.5, -1.5],  # every token outside (r=0.22); the sum too
    [None, None, None, None, None, None],  # no loss token at all (padding row)
    [None, None, None, 0.3, 0.3, 0.3],     # tokens inside; sum 0.9 (2.46) above, geometric mean 1.35 inside
    [0.2, None, -0.3, -0.3, -0.3, 0.1],    # a hole; sum -0.6 (0.55) inside
    [None, None, -0.3, -0.3, -0.3, 0.0],   # sum -0.9 (0.41) below, geometric mean 0.80 inside
]


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows, width = len(LOG_RATIOS), len(LOG_RATIOS[0])
    mask = torch.tensor([[0.0 if d is None else 1.0 for d in row] for row in LOG_RATIOS])
    rollout = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2.0 - 0.05
    delta = torch.tensor([[0.0 if d is None else d for d in row] for row in LOG_RATIOS], dtype=torch.float64)
    old = rollout + delta
    garbage = mask == 0  # what padding may hold: it must never reach a value or a gradient
    return {
        "loss_mask": mask,
        "rollout_logprobs": torch.where(garbage, torch.full_like(rollout, 1e4), rollout).float(),
        "old_logprobs": torch.where(garbage, torch.full_like(old, NEG_INF), old).float(),
        "logprobs": (old - 0.1 * torch.randn(rows, width, generator=g, dtype=torch.float64)).float(),
        "advantages": torch.randn(rows, width, generator=g),
    }


def _tokens(b: dict, i: int) -> list[int]:
    return [t for t in range(b["loss_mask"].shape[1]) if b["loss_mask"][i, t] > 0]


def _reference_weights(b: dict, mode: str) -> tuple[dict[tuple[int, int], float], list[bool]]:
    """``{(row, token): weight}`` over loss tokens, and the masked flag of each unit, from the definitions."""
    weights, masked = {}, []
    for i in range(b["loss_mask"].shape[0]):
        ts = _tokens(b, i)
        logs = [float(b["old_logprobs"][i, t]) - float(b["rollout_logprobs"][i, t]) for t in ts]
        if not ts:
            continue
        if mode in ("token_tis", "token_mask", "none"):
            for t, d in zip(ts, logs):
                r = math.exp(d)
                inside = LOW <= r <= HIGH
                weights[(i, t)] = {"none": 1.0, "token_tis": min(r, CAP), "token_mask": r if inside else 0.0}[mode]
                masked.append(not inside)
            continue
        rho, geo = math.exp(sum(logs)), math.exp(sum(logs) / len(logs))
        inside = LOW <= (geo if mode == "sequence_mis_geo" else rho) <= HIGH
        w = {"sequence_tis": min(rho, CAP), "sequence_mis": rho if inside else 0.0,
             "sequence_mis_geo": 1.0 if inside else 0.0}[mode]
        weights.update({(i, t): w for t in ts})
        masked.append(not inside)
    return weights, masked


def _config(mode: str) -> AlgorithmConfig:
    return AlgorithmConfig(policy_loss_type="cross_entropy", off_policy_correction=mode, tis_cap=CAP,
                           is_ratio_low=LOW, is_ratio_high=HIGH)


def _loss_grad(b: dict, cfg: AlgorithmConfig):
    lp = b["logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss_fn(lp, None, b, LossContext.for_minibatch(cfg, b["loss_mask"]))
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_the_batch_tells_the_modes_apart():
    b = _batch()
    masks = {mode: tuple(_reference_weights(b, mode)[1]) for mode in MASKING_CORRECTIONS}
    assert len(set(masks.values())) == len(MASKING_CORRECTIONS), masks
    assert all(any(m) and not all(m) for m in masks.values()), masks


@pytest.mark.parametrize("mode", OFF_POLICY_CORRECTIONS)
def test_weighted_loss_and_gradient_match_reference(mode):
    """cross_entropy: loss = sum_t w_t (-A_t logp_t), so d loss / d logp_t = -w_t A_t exactly."""
    b = _batch()
    loss, grad, metrics = _loss_grad(b, _config(mode))
    weights, masked = _reference_weights(b, mode)
    ref_grad = torch.zeros_like(grad)
    for (i, t), w in weights.items():
        ref_grad[i, t] = -w * float(b["advantages"][i, t])
    ref_loss = sum(-w * float(b["advantages"][i, t]) * float(b["logprobs"][i, t]) for (i, t), w in weights.items())
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert torch.isfinite(grad).all() and torch.all(grad[b["loss_mask"] == 0] == 0)
    final = finalize_metrics(metrics)
    if mode in MASKING_CORRECTIONS:
        assert final["off_policy/masked_frac"] == pytest.approx(sum(masked) / len(masked), abs=1e-7)
        assert metrics["off_policy/masked_frac"].count == len(masked)  # units: tokens or non-empty sequences
    else:
        assert "off_policy/masked_frac" not in final


@pytest.mark.parametrize("mode", MASKING_CORRECTIONS)
def test_a_fully_masked_sequence_gives_zero_gradient_and_no_nan(mode):
    b = _batch()
    _, grad, metrics = _loss_grad(b, _config(mode))
    assert torch.all(grad[1] == 0)  # row 1: every token and its sum outside the band in every masking mode
    assert all(math.isfinite(v) for v in finalize_metrics(metrics).values())
    everything = {**b, "loss_mask": torch.zeros_like(b["loss_mask"])}
    loss, grad, metrics = _loss_grad(everything, _config(mode))
    assert float(loss) == 0.0 and torch.all(grad == 0)
    assert finalize_metrics(metrics)["off_policy/masked_frac"] == 0.0


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mis", "sequence_mis_geo"])
def test_band_ends_are_inside(mode):
    """A ratio equal to is_ratio_low or is_ratio_high keeps its weight; a band end one float32 step inside the
    ratio (the ratio just outside the band) masks it."""
    mask = torch.ones(1, 1)
    rollout = torch.full((1, 1), -1.0)
    for end in ("low", "high"):
        old = rollout + (-0.25 if end == "low" else 0.25)
        r = float(torch.exp(old - rollout))  # the float32 ratio the implementation computes
        beyond = float(torch.nextafter(torch.tensor(r), torch.tensor(10.0 if end == "low" else 0.0)))
        for bound, kept in ((r, True), (beyond, False)):
            low, high = (bound, 2.0) if end == "low" else (0.5, bound)
            cfg = AlgorithmConfig(off_policy_correction=mode, is_ratio_low=low, is_ratio_high=high)
            weights, _ = off_policy_weights(old, rollout, mask, cfg)
            expected = (1.0 if mode == "sequence_mis_geo" else r) if kept else 0.0
            assert float(weights) == pytest.approx(expected, rel=1e-6), (end, bound, kept)


def test_importance_ratio_metrics_match_reference():
    b = _batch()
    metrics = finalize_metrics(importance_ratio_metrics(b["old_logprobs"], b["rollout_logprobs"], b["loss_mask"]))
    ratios = [math.exp(d) for row in LOG_RATIOS for d in row if d is not None]
    assert metrics["off_policy/ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert metrics["off_policy/ratio_min"] == pytest.approx(min(ratios), rel=1e-5)
    assert metrics["off_policy/ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    empty = finalize_metrics(importance_ratio_metrics(b["old_logprobs"], b["rollout_logprobs"],
                                                      torch.zeros_like(b["loss_mask"])))
    assert empty == {"off_policy/ratio_mean": 0.0, "off_policy/ratio_min": 0.0, "off_policy/ratio_max": 0.0}
