"""Advantage estimators (registry) and the step-wise broadcast (docs/DESIGN.md sections 2 and 6).

Place in the data flow: batch tensors ``[B, R]`` (right-aligned, docs/DESIGN.md section 2) -> here ->
``normalization.py`` (per mini-batch reduction weights) -> losses.

Every estimator is ``fn(token_level_rewards [B, R], response_mask [B, R], uids: list (len B), config,
values [B, R] | None) -> (advantages [B, R], returns [B, R])``, zero outside ``response_mask``.

- ``grpo``: outcome score ``s_i = sum_t r_it``; ``A_i = (s_i - mean_g) / (std_g + 1e-6)`` over the rows that
  share a uid (``grpo_norm_by_std=False``: ``A_i = s_i - mean_g``, Dr. GRPO). Unbiased std. A singleton group
  has no baseline: mean 0 and std 1, so ``A_i = s_i`` (as verl / SkyRL), never NaN.
- ``rloo``: ``A_i = s_i - mean_{j != i in g} s_j``; a singleton group gets ``A_i = s_i``.
- ``reinforce++``: discounted returns ``G_t = r_t + gamma G_{t+1}`` then whole-batch whitening over the mask.
- ``gae``: needs ``values``; ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lambda A_{t+1}``
  over ACTION tokens (its mask argument is the action mask: the Trainer passes ``loss_mask``); masked columns
  (observation tokens inside a response) are skipped, so ``t + 1`` is the next action token and its value
  bootstraps across the observation; returns ``A + V``; advantages whitened over the batch
  (docs/DESIGN.md section 13).

Step-wise (``is_last_step`` given): outcome estimators run on the last steps only with an all-ones mask;
each trajectory's scalar (column R-1 of its last step) is broadcast to every step of the trajectory times that
step's OWN ``response_mask``. Temporal estimators are rejected.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from megatron_rl.algorithms.normalization import whiten_advantages
from megatron_rl.algorithms.settings import AlgorithmSettings

EstimatorFn = Callable[
    [torch.Tensor, torch.Tensor, Sequence[Hashable], AlgorithmSettings, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor]",
]

ADVANTAGE_ESTIMATORS: dict[str, EstimatorFn] = {}
"""Registry name -> estimator; extend with ``register_advantage_estimator``."""

TEMPORAL_ESTIMATORS: set[str] = set()
"""Registered estimators with per-token credit (``temporal=True``): not usable with step-wise trajectories."""

GRPO_EPS = 1e-6
"""Added to the group std (GRPO) so a group of equal scores gives zero advantages."""


def register_advantage_estimator(name: str, *, temporal: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator adding ``fn`` to ``ADVANTAGE_ESTIMATORS`` under ``name`` (a duplicate name is an error).

    ``temporal``: the estimator assigns per-token credit from the token rewards, so it cannot run step-wise.
    """
    def deco(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:  # a ValueError, not an assert: under python -O it would replace it
            raise ValueError(f"advantage estimator {name!r} is already registered; pick another name "
                             f"(registered: {sorted(ADVANTAGE_ESTIMATORS)})")
        ADVANTAGE_ESTIMATORS[name] = fn
        if temporal:
            TEMPORAL_ESTIMATORS.add(name)
        return fn
    return deco


def get_advantage_estimator(name: str) -> EstimatorFn:
    """The registered estimator ``name``; ValueError listing the valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage_estimator={name!r} is not registered; valid: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    return ADVANTAGE_ESTIMATORS[name]


# ---------------------------------------------------------------------------------------------------------------
# Outcome estimators (group baselines)
# ---------------------------------------------------------------------------------------------------------------

def _group_stats(scores: torch.Tensor, uids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group ``(index [B], count [B], sum [B])`` of ``scores [B]`` grouped by equal uid."""
    if len(uids) != scores.shape[0]:
        raise ValueError(f"got {len(uids)} uids for {scores.shape[0]} rows; pass one uid per row")
    first_seen: dict[Hashable, int] = {}
    index = torch.tensor([first_seen.setdefault(u, len(first_seen)) for u in uids], dtype=torch.long)
    num_groups = len(first_seen)
    count = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, index, scores)
    return index, count[index], total[index]


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence score ``[B]``: the sum of the token rewards over the response (fp32)."""
    return (token_level_rewards.float() * response_mask.float()).sum(dim=-1)


@register_advantage_estimator("grpo")
def grpo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
                    config: AlgorithmSettings, values: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO / Dr. GRPO (module docstring); returns ``(A, A)`` as ``[B, R]``."""
    scores = _outcome_scores(token_level_rewards, response_mask)  # [B]
    index, count, total = _group_stats(scores, uids)
    singleton = count <= 1
    mean = torch.where(singleton, torch.zeros_like(scores), total / count)
    group_sq = torch.zeros_like(scores).index_add_(0, index, (scores - total / count) ** 2)
    std = torch.where(singleton, torch.ones_like(scores), torch.sqrt(group_sq[index] / (count - 1).clamp(min=1)))
    adv = scores - mean
    if config.grpo_norm_by_std:
        adv = adv / (std + GRPO_EPS)
    adv = adv[:, None] * response_mask.float()
    return adv, adv


@register_advantage_estimator("rloo")
def rloo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
                    config: AlgorithmSettings, values: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline (module docstring); returns ``(A, A)`` as ``[B, R]``."""
    scores = _outcome_scores(token_level_rewards, response_mask)  # [B]
    _, count, total = _group_stats(scores, uids)
    baseline = torch.where(count <= 1, torch.zeros_like(scores), (total - scores) / (count - 1).clamp(min=1))
    adv = (scores - baseline)[:, None] * response_mask.float()
    return adv, adv


# ---------------------------------------------------------------------------------------------------------------
# Temporal estimators (per-token credit; not usable step-wise)
# ---------------------------------------------------------------------------------------------------------------

def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over response tokens ``[B, R]``; masked columns carry G unchanged, 0 out."""
    mask = response_mask.float()
    rewards = token_level_rewards.float() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@register_advantage_estimator("reinforce++", temporal=True)
def reinforce_pp_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                            uids: Sequence[Hashable], config: AlgorithmSettings, values: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: whitened discounted returns; returns ``(whiten(G), G)`` as ``[B, R]``."""
    returns = discounted_returns(token_level_rewards, response_mask, config.gamma)
    return whiten_advantages(returns, response_mask), returns


@register_advantage_estimator("gae", temporal=True)
def gae_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
                   config: AlgorithmSettings, values: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the action tokens of each row; returns ``(whiten(A), A + V)`` as ``[B, R]``, zero off the mask.

    ``response_mask [B, R]`` here is the ACTION mask (pass ``loss_mask``: 1 on tokens the policy sampled).
    ``values [B, R]``: column k is V of the state before token k (docs/DESIGN.md section 13), the convention
    of the log-probs. Holes in the mask (observation tokens inside a response, after merging turns) are not
    time steps: they are skipped, so for an action token t the "next" state is the next action token's, and
    ``V_{t+1}`` bootstraps across the observation (no discount is applied to the skipped tokens). A reward on a
    skipped column belongs to the transition of the last action token before it and is added to that token's
    reward (a reward left of a row's first action token has no action to credit and is dropped). After a
    row's last action token the value is 0 (the episode ends with the response).
    """
    if values is None:
        raise ValueError("advantage_estimator='gae' needs critic values [B, R]; pass values= (train a critic)")
    if values.shape != response_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} must have the [B, R] shape of the mask "
                         f"{tuple(response_mask.shape)} (right-aligned, docs/DESIGN.md section 2)")
    mask = response_mask.float()
    rewards, values = token_level_rewards.float(), values.detach().float()
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    pending = torch.zeros_like(rewards[:, 0])  # rewards of skipped columns right of the current one
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0
        reward = rewards[:, t] + pending
        delta = reward + config.gamma * next_value - values[:, t]
        last_gae = torch.where(valid, delta + config.gamma * config.lambd * last_gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        pending = torch.where(valid, torch.zeros_like(pending), reward)
        adv[:, t] = last_gae
    adv = adv * mask
    returns = (adv + values) * mask
    return whiten_advantages(adv, mask), returns


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------

def trajectory_index(is_last_step: Sequence[bool]) -> torch.Tensor:
    """Trajectory number ``[B]`` of each row: rows up to and including an ``is_last_step`` row form one."""
    if len(is_last_step) == 0 or not is_last_step[-1]:
        raise ValueError(
            "is_last_step must end with True (every step belongs to a trajectory that ends at a last step); "
            "check the step-wise rollout order"
        )
    last = torch.tensor([bool(x) for x in is_last_step], dtype=torch.long)
    return torch.cumsum(last, 0) - last  # last steps before row i


def compute_advantages_and_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   uids: Sequence[Hashable], estimator: str, config: AlgorithmSettings,
                                   values: torch.Tensor | None = None,
                                   is_last_step: Sequence[bool] | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, R]`` (fp32) for a whole batch, zero outside ``response_mask``.

    ``is_last_step`` (len B) switches to step-wise: see the module docstring.
    """
    fn = get_advantage_estimator(estimator)
    if is_last_step is None:
        return fn(token_level_rewards, response_mask, uids, config, values)
    if estimator in TEMPORAL_ESTIMATORS:
        raise ValueError(
            f"advantage_estimator={estimator!r} is temporal and cannot run step-wise (is_last_step given); "
            "use an outcome estimator such as 'grpo' or 'rloo'"
        )
    if len(is_last_step) != response_mask.shape[0] or len(uids) != response_mask.shape[0]:
        raise ValueError(
            f"is_last_step has {len(is_last_step)} and uids {len(uids)} entries for {response_mask.shape[0]} "
            "rows; pass one per row"
        )
    traj = trajectory_index(is_last_step)  # [B]
    last_rows = [i for i, last in enumerate(is_last_step) if last]
    last_rewards = token_level_rewards[last_rows]  # [N, R]
    adv_last, ret_last = fn(last_rewards, torch.ones_like(last_rewards), [uids[i] for i in last_rows], config, None)
    mask = response_mask.float()
    return adv_last[traj, -1:] * mask, ret_last[traj, -1:] * mask
