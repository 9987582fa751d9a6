"""Advantage estimators against slow per-row loop references, and the step-wise broadcast regression."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from tests.support.alg_helpers import right_aligned_mask

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages_and_returns
from megatron_rl.config import AlgorithmConfig


def _outcome_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    uids = ["a", "a", "a", "b", "b", "c", "d", "d", "d", "d"]  # "c" is a singleton group
    lengths = torch.randint(1, 7, (len(uids),), generator=g).tolist()
    mask = right_aligned_mask(lengths, 6)
    rewards = torch.zeros_like(mask)
    rewards[:, -1] = torch.randint(0, 3, (len(uids),), generator=g).float()  # outcome reward on the last token
    rewards[3, -1] = rewards[4, -1]  # a group of equal scores gets zero advantage
    return rewards, mask, uids


def _loop_group_advantage(scores: list[float], uids: list, kind: str, norm_by_std: bool) -> list[float]:
    out = []
    for i, u in enumerate(uids):
        group = [scores[j] for j in range(len(uids)) if uids[j] == u]
        if len(group) == 1:
            out.append(scores[i])
        elif kind == "rloo":
            others = [scores[j] for j in range(len(uids)) if uids[j] == u and j != i]
            out.append(scores[i] - sum(others) / len(others))
        else:
            centered = scores[i] - statistics.mean(group)
            out.append(centered / (statistics.stdev(group) + 1e-6) if norm_by_std else centered)
    return out


@pytest.mark.parametrize("kind,norm_by_std", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_outcome_estimators_match_loop(kind, norm_by_std):
    rewards, mask, uids = _outcome_batch(0)
    cfg = AlgorithmConfig(grpo_norm_by_std=norm_by_std)
    adv, ret = compute_advantages_and_returns(rewards, mask, uids, kind, cfg)
    scores = [float((rewards[i] * mask[i]).sum()) for i in range(len(uids))]
    expected = _loop_group_advantage(scores, uids, kind, norm_by_std)
    for i, e in enumerate(expected):
        n = int(mask[i].sum())
        torch.testing.assert_close(adv[i, -n:], torch.full((n,), e), rtol=1e-5, atol=1e-5)
        assert torch.all(adv[i, :-n] == 0) if n < mask.shape[1] else True
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(ret, adv)
    assert torch.all(adv[3:5] == 0)  # equal scores -> zero advantages


def _loop_whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean = statistics.mean(flat)
    std = math.sqrt(statistics.variance(flat) + 1e-8)
    return [[(x - mean) / std for x in row] for row in rows]


def _temporal_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 7, 1, 4]
    mask = right_aligned_mask(lengths, 7)
    rewards = torch.randn(len(lengths), 7, generator=g) * mask
    values = torch.randn(len(lengths), 7, generator=g)
    return rewards, mask, values, lengths


def test_reinforce_pp_matches_loop():
    rewards, mask, _, lengths = _temporal_batch(1)
    cfg = AlgorithmConfig(gamma=0.9)
    adv, ret = compute_advantages_and_returns(rewards, mask, list(range(len(lengths))), "reinforce++", cfg)
    ret_rows = []
    for i, n in enumerate(lengths):
        r = rewards[i, -n:].tolist()
        g_row, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = r[t] + 0.9 * running
            g_row[t] = running
        ret_rows.append(g_row)
    for i, (n, g_row, a_row) in enumerate(zip(lengths, ret_rows, _loop_whiten(ret_rows))):
        torch.testing.assert_close(ret[i, -n:], torch.tensor(g_row), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adv[i, -n:], torch.tensor(a_row), rtol=1e-4, atol=1e-5)
        assert torch.all(adv[i, :-n] == 0) and torch.all(ret[i, :-n] == 0)


def test_gae_matches_loop():
    rewards, mask, values, lengths = _temporal_batch(2)
    cfg = AlgorithmConfig(gamma=0.95, lambd=0.8)
    adv, ret = compute_advantages_and_returns(rewards, mask, list(range(len(lengths))), "gae", cfg, values=values)
    adv_rows, ret_rows = [], []
    for i, n in enumerate(lengths):
        r, v = rewards[i, -n:].tolist(), values[i, -n:].tolist()
        a_row, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            last = r[t] + 0.95 * next_v - v[t] + 0.95 * 0.8 * last
            a_row[t] = last
        adv_rows.append(a_row)
        ret_rows.append([a + b for a, b in zip(a_row, v)])
    for i, (n, a_row) in enumerate(zip(lengths, _loop_whiten(adv_rows))):
        torch.testing.assert_close(adv[i, -n:], torch.tensor(a_row), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ret[i, -n:], torch.tensor(ret_rows[i]), rtol=1e-5, atol=1e-5)
        assert torch.all(adv[i, :-n] == 0) and torch.all(ret[i, :-n] == 0)


def test_singleton_groups_are_finite():
    mask = right_aligned_mask([3, 1], 4)
    rewards = torch.zeros(2, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0])
    for name in ("grpo", "rloo"):
        for norm in (True, False):
            adv, _ = compute_advantages_and_returns(rewards, mask, ["x", "y"], name,
                                                    AlgorithmConfig(grpo_norm_by_std=norm))
            assert torch.isfinite(adv).all()
            torch.testing.assert_close(adv[:, -1], torch.tensor([1.0, 0.0]))  # no baseline: A = score


def test_registry_errors():
    rewards, mask, uids = _outcome_batch(3)
    with pytest.raises(ValueError, match="valid:.*grpo.*rloo"):
        compute_advantages_and_returns(rewards, mask, uids, "ppo_magic", AlgorithmConfig())
    with pytest.raises(ValueError, match="values"):
        compute_advantages_and_returns(rewards, mask, uids, "gae", AlgorithmConfig())
    with pytest.raises(ValueError, match="uids"):
        compute_advantages_and_returns(rewards, mask, uids[:-1], "grpo", AlgorithmConfig())
    assert set(ADVANTAGE_ESTIMATORS) >= {"grpo", "rloo", "reinforce++", "gae"}


def test_duplicate_estimator_name_is_a_value_error():
    """A ValueError, not an assert: under ``python -O`` an assert would let ``grpo`` be silently replaced."""
    from megatron_rl.algorithms.advantages import register_advantage_estimator

    grpo = ADVANTAGE_ESTIMATORS["grpo"]
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage_estimator("grpo")(lambda *args, **kwargs: None)
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo


# ---------------------------------------------------------------------------------------------------------------
# Step-wise
# ---------------------------------------------------------------------------------------------------------------

def _stepwise_batch():
    """Trajectories of steps with different prompt/response lengths, laid out right-aligned in one block.

    Earlier steps often have LONGER responses than the last step (the case where broadcasting the last step's
    mask, or a left-aligned slice, gives earlier steps zeros or the wrong tokens).
    """
    # (uid, trajectory, prompt_len, response_len, outcome reward on last step)
    steps = [
        ("p0", 0, 3, 6, None), ("p0", 0, 8, 2, None), ("p0", 0, 12, 1, 1.0),
        ("p0", 1, 3, 4, None), ("p0", 1, 9, 5, 0.0),
        ("p0", 2, 3, 3, 1.0),
        ("p1", 3, 4, 2, None), ("p1", 3, 7, 6, None), ("p1", 3, 14, 3, 0.5),
        ("p1", 4, 4, 5, 2.0),
    ]
    width = max(s[3] for s in steps)
    response_mask = right_aligned_mask([s[3] for s in steps], width)
    rewards = torch.zeros(len(steps), width)
    for i, s in enumerate(steps):
        if s[4] is not None:
            rewards[i, -1] = s[4]  # outcome reward: last response token of the last step (column R-1)
    is_last = [s[4] is not None for s in steps]
    return steps, response_mask, rewards, is_last


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_stepwise_broadcast_every_step_gets_its_trajectory_advantage(kind):
    steps, response_mask, rewards, is_last = _stepwise_batch()
    uids = [s[0] for s in steps]
    adv, ret = compute_advantages_and_returns(rewards, response_mask, uids, kind, AlgorithmConfig(),
                                              is_last_step=is_last)
    last_rows = [i for i, last in enumerate(is_last) if last]
    traj_scalar = dict(zip(
        [steps[i][1] for i in last_rows],
        _loop_group_advantage([steps[i][4] for i in last_rows], [uids[i] for i in last_rows], kind, True)))
    for i, (_, traj, _, n, _) in enumerate(steps):
        expected = torch.zeros(response_mask.shape[1])
        expected[-n:] = traj_scalar[traj]  # exactly this step's own response tokens
        torch.testing.assert_close(adv[i], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret[i], expected, rtol=1e-5, atol=1e-6)
    earlier = [i for i, last in enumerate(is_last) if not last and traj_scalar[steps[i][1]] != 0]
    assert earlier and all(adv[i].abs().sum() > 0 for i in earlier)  # earlier steps never get zeros


def test_stepwise_rejections():
    steps, response_mask, rewards, is_last = _stepwise_batch()
    uids = [s[0] for s in steps]
    for temporal in ("gae", "reinforce++"):
        with pytest.raises(ValueError, match="temporal"):
            compute_advantages_and_returns(rewards, response_mask, uids, temporal, AlgorithmConfig(),
                                           values=torch.zeros_like(rewards), is_last_step=is_last)
    with pytest.raises(ValueError, match="end with True"):
        compute_advantages_and_returns(rewards, response_mask, uids, "grpo", AlgorithmConfig(),
                                       is_last_step=is_last[:-1] + [False])
    with pytest.raises(ValueError, match="one per row"):
        compute_advantages_and_returns(rewards, response_mask, uids, "grpo", AlgorithmConfig(),
                                       is_last_step=is_last[:-1])
