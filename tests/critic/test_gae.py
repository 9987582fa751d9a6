"""GAE over action tokens (docs/DESIGN.md section 13) against a per-row loop over the list of action tokens.

The reference never looks at masked columns as time steps: it extracts each row's action tokens in order
(loss mask 1), credits rewards of skipped columns (observations) to the action token before them, runs the
textbook GAE recursion on that short list, and whitens over all action tokens of the batch.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.algorithms.advantages import compute_advantages_and_returns
from megatron_rl.config import AlgorithmConfig


def _batch(seed: int):
    """Uneven rows (one of them without any action token), holes in the loss mask, rewards on every response
    column (also on observation columns), garbage values off the mask."""
    g = torch.Generator().manual_seed(seed)
    width, lengths = 9, [9, 3, 6, 1, 5, 4]
    response_mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        response_mask[i, width - n:] = 1
    loss_mask = response_mask * (torch.rand(len(lengths), width, generator=g) > 0.3).float()
    loss_mask[0, 2:5] = 0  # an observation block of three tokens inside row 0
    loss_mask[0, -1] = 1
    loss_mask[3] = 0  # a row with no action token
    rewards = torch.randn(len(lengths), width, generator=g) * response_mask
    values = torch.randn(len(lengths), width, generator=g) * 3
    return rewards, response_mask, loss_mask, values


def _reference(rewards, loss_mask, values, gamma, lambd):
    """Per-row loop over the action tokens; returns (whitened advantages, returns) as lists of {column: x}."""
    adv_rows, ret_rows = [], []
    for r, m, v in zip(rewards.tolist(), loss_mask.tolist(), values.tolist()):
        actions = [k for k, x in enumerate(m) if x > 0]
        credited = {}
        for k in actions:  # rewards of the columns up to the next action belong to action k
            nxt = next((a for a in actions if a > k), len(m))
            credited[k] = sum(r[k:nxt])
        adv, last = {}, 0.0
        for idx in reversed(range(len(actions))):
            k = actions[idx]
            next_v = v[actions[idx + 1]] if idx + 1 < len(actions) else 0.0
            last = credited[k] + gamma * next_v - v[k] + gamma * lambd * last
            adv[k] = last
        adv_rows.append(adv)
        ret_rows.append({k: a + v[k] for k, a in adv.items()})
    flat = [a for row in adv_rows for a in row.values()]
    mean, std = statistics.mean(flat), math.sqrt(statistics.variance(flat) + 1e-8)
    return [{k: (a - mean) / std for k, a in row.items()} for row in adv_rows], ret_rows


@pytest.mark.parametrize("seed, gamma, lambd", [(0, 1.0, 1.0), (1, 0.9, 0.8), (2, 0.5, 0.0)])
def test_gae_skips_holes_like_the_loop(seed, gamma, lambd):
    rewards, _, loss_mask, values = _batch(seed)
    cfg = AlgorithmConfig(advantage_estimator="gae", gamma=gamma, lambd=lambd)
    adv, ret = compute_advantages_and_returns(rewards, loss_mask, list(range(len(rewards))), "gae", cfg,
                                              values=values)
    ref_adv, ref_ret = _reference(rewards, loss_mask, values, gamma, lambd)
    for i in range(len(rewards)):
        for k in range(rewards.shape[1]):
            want_a, want_g = ref_adv[i].get(k, 0.0), ref_ret[i].get(k, 0.0)  # 0 off the action tokens
            assert adv[i, k].item() == pytest.approx(want_a, abs=1e-5), (i, k)
            assert ret[i, k].item() == pytest.approx(want_g, abs=1e-5), (i, k)


def test_observation_block_is_bootstrapped_across():
    """One row: action, three observation tokens, action. With lambda = 0 the first action's advantage is
    r + gamma * V(next action) - V(first action): the observation tokens' values play no part."""
    loss_mask = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 100.0, -100.0, 7.0, 2.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.3, 0.0, 1.0]])  # 0.3 sits on an observation token
    cfg = AlgorithmConfig(advantage_estimator="gae", gamma=0.9, lambd=0.0)
    _, ret = compute_advantages_and_returns(rewards, loss_mask, [0], "gae", cfg, values=values)
    assert ret[0, 0].item() == pytest.approx(0.3 + 0.9 * 2.0)  # G = A + V = r + gamma V_next
    assert ret[0, 4].item() == pytest.approx(1.0)
    assert torch.all(ret[0, 1:4] == 0)


def test_gae_value_shape_must_match():
    with pytest.raises(ValueError, match="values"):
        compute_advantages_and_returns(torch.zeros(2, 3), torch.ones(2, 3), [0, 1], "gae",
                                       AlgorithmConfig(), values=torch.zeros(2, 4))
