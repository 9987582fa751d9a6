"""KL(policy || reference) estimators, per token (pure math on ``[B, R]``).

Place in the data flow: used by ``losses.policy_loss_fn`` (``use_kl_loss``: a token-mean loss term) or by
``apply_kl_to_rewards`` before the advantages (``use_kl_in_reward``). With ``x = logp - ref_logp``:

    k1   x                        (unbiased, can be negative)
    k2   x^2 / 2
    k3   exp(-x) + x - 1          (unbiased, >= 0; Schulman's estimator)
    abs  |x|

``x`` is zeroed at masked positions before any arithmetic (so padding garbage such as -inf never makes a NaN,
in the value or the gradient) and clamped to ``[-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP]``; k3 is clamped to
``[-K3_CLAMP, K3_CLAMP]`` so one outlier token cannot dominate.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.metrics import Metric, mean_metric

KL_LOG_RATIO_CLAMP = 20.0
"""|logp - ref_logp| is clamped to this before exponentiation (exp(20) ~ 5e8 stays finite in fp32)."""
K3_CLAMP = 10.0
"""k3 values are clamped to [-K3_CLAMP, K3_CLAMP]."""

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x.square(),
    "k3": lambda x: (torch.exp(-x) + x - 1.0).clamp(min=-K3_CLAMP, max=K3_CLAMP),
    "abs": lambda x: x.abs(),
}
"""Estimator name -> fn(log_ratio [..]) -> kl [..] (``algorithm.kl_estimator_type``)."""


def masked_log_ratio(logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor,
                     clamp: float | None = KL_LOG_RATIO_CLAMP) -> torch.Tensor:
    """``logprobs - other_logprobs`` ``[B, R]``, exactly 0 where ``mask`` is 0, optionally clamped."""
    valid = mask > 0
    zeros = torch.zeros_like(logprobs)
    x = torch.where(valid, logprobs, zeros) - torch.where(valid, other_logprobs.to(logprobs.dtype), zeros)
    return x if clamp is None else x.clamp(min=-clamp, max=clamp)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
               kl_estimator_type: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` (0 where masked); differentiable in ``logprobs``."""
    if kl_estimator_type not in KL_ESTIMATORS:
        raise ValueError(
            f"algorithm.kl_estimator_type={kl_estimator_type!r} is unknown; valid: {sorted(KL_ESTIMATORS)}"
        )
    kl = KL_ESTIMATORS[kl_estimator_type](masked_log_ratio(logprobs, ref_logprobs, mask))
    return torch.where(mask > 0, kl, torch.zeros_like(kl))


def apply_kl_to_rewards(token_level_rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                        response_mask: torch.Tensor, kl_coef: float, kl_estimator_type: str = "k1"
                        ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """``rewards - kl_coef * KL`` per token ``[B, R]`` (``use_kl_in_reward``), before the advantages.

    ``logprobs`` are the rollout policy's (old) logprobs; nothing here is differentiated. Returns the new
    rewards and the token-mean KL metric ``"kl_in_reward/kl"``.
    """
    kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), response_mask, kl_estimator_type)
    rewards = token_level_rewards.float() - kl_coef * kl
    return rewards, {"kl_in_reward/kl": mean_metric(kl, response_mask)}
