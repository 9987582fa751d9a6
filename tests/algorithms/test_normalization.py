"""Per-mini-batch advantage normalization and whitening against loop references; the critic never normalizes."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from tests.support.alg_helpers import random_batch

from megatron_rl.algorithms import (
    LossContext,
    normalize_advantages_per_minibatch,
    normalize_minibatch_advantages,
    value_loss_fn,
    whiten_advantages,
)
from megatron_rl.algorithms.normalization import LOSS_REDUCTIONS
from megatron_rl.config import AlgorithmConfig

MAX_SEQ_LEN = 16


def _loop_divisor(loss_mask: torch.Tensor, i: int, reduction: str) -> float:
    rows = loss_mask.shape[0]
    if reduction == "token_mean":
        return max(1.0, sum(float(x) for row in loss_mask for x in row))
    if reduction == "sequence_mean":
        return rows * max(1.0, sum(float(x) for x in loss_mask[i]))
    return rows * MAX_SEQ_LEN


@pytest.mark.parametrize("reduction", LOSS_REDUCTIONS)
def test_normalize_matches_loop(reduction):
    b = random_batch(0)
    out = normalize_minibatch_advantages(b["advantages"], b["loss_mask"], reduction, MAX_SEQ_LEN)
    for i in range(out.shape[0]):
        expected = b["advantages"][i] / _loop_divisor(b["loss_mask"], i, reduction)
        torch.testing.assert_close(out[i], expected)


@pytest.mark.parametrize("reduction", LOSS_REDUCTIONS)
def test_all_masked_minibatch_gives_finite_zeros_loss(reduction):
    adv = torch.randn(3, 5)
    out = normalize_minibatch_advantages(adv, torch.zeros(3, 5), reduction, MAX_SEQ_LEN)
    assert torch.isfinite(out).all()
    masked = out * torch.zeros(3, 5)
    assert torch.all(masked == 0)


def test_reduction_errors():
    adv, mask = torch.randn(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="valid:.*sequence_mean.*token_mean"):
        normalize_minibatch_advantages(adv, mask, "mean_of_means")
    with pytest.raises(ValueError, match="max_seq_len"):
        normalize_minibatch_advantages(adv, mask, "seq_mean_token_sum_norm")


def test_per_minibatch_boundaries():
    b = random_batch(1, rows=9)
    bounds = [(0, 4), (4, 5), (5, 9)]
    out = normalize_advantages_per_minibatch(b["advantages"], b["loss_mask"], bounds, "sequence_mean")
    for start, end in bounds:
        expected = normalize_minibatch_advantages(b["advantages"][start:end], b["loss_mask"][start:end],
                                                  "sequence_mean")
        torch.testing.assert_close(out[start:end], expected)
    for bad in ([(0, 4), (5, 9)], [(0, 4), (4, 8)], [(0, 0), (0, 9)]):
        with pytest.raises(ValueError, match="boundaries"):
            normalize_advantages_per_minibatch(b["advantages"], b["loss_mask"], bad, "token_mean")


def test_whitening_matches_loop():
    b = random_batch(2)
    adv, mask = b["advantages"], b["loss_mask"]
    out = whiten_advantages(adv, mask)
    valid = [float(adv[i, j]) for i in range(adv.shape[0]) for j in range(adv.shape[1]) if mask[i, j] > 0]
    mean, std = statistics.mean(valid), math.sqrt(statistics.variance(valid) + 1e-8)
    for i in range(adv.shape[0]):
        for j in range(adv.shape[1]):
            expected = (float(adv[i, j]) - mean) / std if mask[i, j] > 0 else 0.0
            assert abs(float(out[i, j]) - expected) < 1e-5
    assert torch.all(whiten_advantages(adv, torch.zeros_like(mask)) == 0)
    assert torch.isfinite(whiten_advantages(adv, torch.zeros_like(mask))).all()


def test_critic_path_leaves_advantages_untouched():
    b = random_batch(3)
    cfg = AlgorithmConfig(loss_reduction="sequence_mean")
    mb = {"loss_mask": b["loss_mask"], "advantages": b["advantages"].clone(), "returns": torch.randn(7, 9),
          "values": torch.randn(7, 9)}
    before = mb["advantages"].clone()
    ctx = LossContext.for_minibatch(cfg, b["loss_mask"])
    values = torch.randn(7, 9, requires_grad=True)
    loss, _ = value_loss_fn(values, None, mb, ctx)
    assert torch.equal(mb["advantages"], before)
    mb_other = {**mb, "advantages": torch.randn(7, 9) * 100}
    loss_other, _ = value_loss_fn(values, None, mb_other, ctx)
    assert torch.equal(loss, loss_other)  # the critic does not read the advantages at all
