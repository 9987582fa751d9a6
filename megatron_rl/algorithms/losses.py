"""Policy losses (registry), off-policy correction, KL / entropy terms, the critic loss, and the loss callables
the backend runs per micro-batch (docs/DESIGN.md section 5, docs/INTERFACES.md "algorithms/").

Place in the data flow: the backend computes ``logprobs [b, R]`` (and ``entropy``) of a micro-batch, then calls
``policy_loss_fn(logprobs, entropy, mb, ctx)`` (or ``value_loss_fn`` for the critic) and hands the returned
summed loss to the gradient-scaling contract.

Contract: every loss is a masked SUM over the micro-batch's loss tokens, never a mean. The reduction
(token_mean, sequence_mean, ...) already lives in the advantages (``normalization.py``), so summing the
micro-batch losses over micro-batches and DP ranks gives exactly the loss of the whole mini-batch. Mean terms
(KL, entropy) divide by ``ctx.minibatch_loss_tokens`` (the mini-batch's total loss tokens) for the same reason.
The critic computes the same reduction weights from ``ctx`` itself and never touches the advantages.

Every registered policy loss is ``fn(logprobs, old_logprobs, advantages, loss_mask, config,
rollout_logprobs=None) -> (summed_loss, dict[str, Metric])`` on ``[b, R]`` tensors, with ``r = exp(logp - old)``:

    regular              max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))                    (PPO)
    dual_clip            regular, and for A < 0 also min(., -A clip_ratio_c)
    gspo                 regular with the sequence ratio r_i = exp(mean_t(logp - old)) per token, in the
                         GSPO-token form exp(sg[log r_i] + logp - sg[logp]): its value is r_i, its gradient
                         per token is r_i * grad logp; the per-token advantages carry the reduction weights,
                         so sequence_mean reproduces GSPO's per-sequence mean exactly
    cispo                -A sg[clip(r, 1 - eps_low, 1 + eps_high)] logp                       (CISPO)
    cross_entropy        -A logp    (SFT: set the advantages to the response mask before the per-mini-batch
                         normalization; then A holds the reduction weights and the loss is the mean NLL
                         under loss_reduction; other advantages give weighted SFT)
    importance_sampling  -A r

Off-policy correction (``config.off_policy_correction``) multiplies the per-token loss by an importance weight
of ``pi_old / pi_rollout`` computed without gradient: truncated (``token_tis``, ``sequence_tis``) or masked
outside a ratio band (``token_mask``, ``sequence_mis``, ``sequence_mis_geo``); formulas in ``off_policy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from megatron_rl.algorithms.kl import apply_kl_to_rewards, kl_penalty, masked_log_ratio
from megatron_rl.algorithms.normalization import reduction_weights
from megatron_rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, off_policy_weights
from megatron_rl.algorithms.settings import AlgorithmSettings
from megatron_rl.metrics import Metric, mean_metric

__all__ = [
    "DISTILL_KL", "OFF_POLICY_CORRECTIONS", "POLICY_LOSSES", "LossContext", "apply_kl_to_rewards", "get_policy_loss",
    "kl_penalty", "off_policy_weights", "policy_loss_fn", "ppo_policy_loss", "register_policy_loss", "value_loss",
    "value_loss_fn",
]

PolicyLossFn = Callable[..., "tuple[torch.Tensor, dict[str, Metric]]"]

DISTILL_KL = "distill_kl"
"""Micro-batch key of on-policy distillation's full-vocabulary KL ``[b, R]`` (``distillation.kind: full_kl``):
``coef * weight * KL(student || teacher)`` per loss token of a teacher's rows, differentiable w.r.t. the student's
logits; added to the loss as a token mean like the reference KL (distillation/full_kl.py fills it)."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Registry name -> policy loss (``algorithm.policy_loss_type``); extend with ``register_policy_loss``."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding ``fn`` to ``POLICY_LOSSES`` under ``name`` (a duplicate name is an error)."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:  # a ValueError, not an assert: under python -O it would replace it
            raise ValueError(f"policy loss {name!r} is already registered; pick another name "
                             f"(registered: {sorted(POLICY_LOSSES)})")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered policy loss ``name``; ValueError listing the valid names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"algorithm.policy_loss_type={name!r} is not registered; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------

def _masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with masked positions replaced by 0 (no NaN / inf from padding reaches values or gradients)."""
    return torch.where(valid, x, torch.zeros_like(x))


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, Metric]:
    return {
        "policy/ratio_mean": mean_metric(ratio, loss_mask),
        "policy/approx_kl": mean_metric(-log_ratio, loss_mask),  # k1 estimate of KL(old || new)
    }


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, config: AlgorithmSettings
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clip loss and the clipped indicator, both ``[b, R]``."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def _finish(loss_tok: torch.Tensor, loss_mask: torch.Tensor, config: AlgorithmSettings, old_logprobs: torch.Tensor,
            rollout_logprobs: torch.Tensor | None, metrics: dict[str, Metric]
            ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Apply the off-policy weights, take the masked SUM, add ``policy/pg_loss`` (reduce="sum")."""
    weights, off_policy_metrics = off_policy_weights(old_logprobs, rollout_logprobs, loss_mask, config)
    if weights is not None:
        loss_tok = loss_tok * weights
    summed = _masked(loss_tok, loss_mask > 0).sum()
    metrics.update(off_policy_metrics)
    metrics["policy/pg_loss"] = Metric(summed, 1.0, "sum")
    return summed, metrics


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return masked_log_ratio(logprobs, old_logprobs.detach(), loss_mask)


# ---------------------------------------------------------------------------------------------------------------
# Registered policy losses
# ---------------------------------------------------------------------------------------------------------------

@register_policy_loss("regular")
def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, config: AlgorithmSettings, rollout_logprobs: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """PPO clip with asymmetric ``eps_clip_low`` / ``eps_clip_high``; summed over loss tokens."""
    log_ratio = _log_ratio(logprobs, old_logprobs, loss_mask)
    ratio = torch.exp(log_ratio)
    loss_tok, clipped = _ppo_clip(ratio, advantages.detach(), config)
    metrics = {**_ratio_metrics(ratio, log_ratio, loss_mask), "policy/clipfrac": mean_metric(clipped, loss_mask)}
    return _finish(loss_tok, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


@register_policy_loss("dual_clip")
def dual_clip_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          loss_mask: torch.Tensor, config: AlgorithmSettings,
                          rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
    """PPO clip, and for negative advantages the loss is capped at ``-A * clip_ratio_c``."""
    log_ratio = _log_ratio(logprobs, old_logprobs, loss_mask)
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    loss_tok, clipped = _ppo_clip(ratio, advantages, config)
    cap = -advantages * config.clip_ratio_c
    dual = (advantages < 0) & (loss_tok > cap)
    loss_tok = torch.where(dual, cap, loss_tok)
    metrics = {
        **_ratio_metrics(ratio, log_ratio, loss_mask),
        "policy/clipfrac": mean_metric(clipped, loss_mask),
        "policy/dual_clipfrac": mean_metric(dual.float(), loss_mask),
    }
    return _finish(loss_tok, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


@register_policy_loss("gspo")
def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     loss_mask: torch.Tensor, config: AlgorithmSettings, rollout_logprobs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GSPO: PPO clip on the sequence-level ratio (geometric mean of the token ratios over loss tokens)."""
    valid = loss_mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, loss_mask)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)  # [b, 1]
    logp = _masked(logprobs, valid)
    token_log_ratio = _masked(seq_log_ratio.detach() + logp - logp.detach(), valid)  # value: seq ratio
    ratio = torch.exp(token_log_ratio)
    loss_tok, clipped = _ppo_clip(ratio, advantages.detach(), config)
    metrics = {**_ratio_metrics(ratio, log_ratio, loss_mask), "policy/clipfrac": mean_metric(clipped, loss_mask)}
    return _finish(loss_tok, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


@register_policy_loss("cispo")
def cispo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      loss_mask: torch.Tensor, config: AlgorithmSettings, rollout_logprobs: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """CISPO: REINFORCE on ``logp`` weighted by the clipped, stop-gradient importance ratio."""
    valid = loss_mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, loss_mask)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    loss_tok = -advantages.detach() * weight * _masked(logprobs, valid)
    metrics = {
        **_ratio_metrics(ratio, log_ratio, loss_mask),
        "policy/clipfrac": mean_metric((weight != ratio).float(), loss_mask),
    }
    return _finish(loss_tok, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


@register_policy_loss("cross_entropy")
def cross_entropy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       loss_mask: torch.Tensor, config: AlgorithmSettings, rollout_logprobs: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """SFT: ``sum(-A * logp)``; the advantages carry the reduction weights (module docstring)."""
    logp = _masked(logprobs, loss_mask > 0)
    metrics = {"policy/nll": mean_metric(-logp, loss_mask)}
    return _finish(-advantages.detach() * logp, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


@register_policy_loss("importance_sampling")
def importance_sampling_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                             loss_mask: torch.Tensor, config: AlgorithmSettings,
                             rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Unclipped importance sampling: ``sum(-r * A)``."""
    log_ratio = _log_ratio(logprobs, old_logprobs, loss_mask)
    ratio = torch.exp(log_ratio)
    metrics = _ratio_metrics(ratio, log_ratio, loss_mask)
    return _finish(-advantages.detach() * ratio, loss_mask, config, old_logprobs, rollout_logprobs, metrics)


# ---------------------------------------------------------------------------------------------------------------
# Critic
# ---------------------------------------------------------------------------------------------------------------

def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               weights: torch.Tensor, value_clip: float) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Clipped value loss ``sum_t w * 0.5 * max((V - G)^2, (V_clip - G)^2)`` over loss tokens ``[b, R]``.

    ``V_clip = V_old + clip(V - V_old, -value_clip, value_clip)``; ``weights`` (``[b, 1]`` or ``[b, R]``) are the
    mini-batch reduction weights, so the summed loss follows ``loss_reduction`` like the policy loss.
    """
    valid = loss_mask > 0
    values, old_values, returns = _masked(values, valid), _masked(old_values, valid), _masked(returns, valid)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_err, clipped_err = (values - returns).square(), (clipped_values - returns).square()
    loss_tok = 0.5 * torch.maximum(unclipped_err, clipped_err) * weights
    summed = _masked(loss_tok, valid).sum()
    return summed, {
        "critic/value_loss": Metric(summed, 1.0, "sum"),
        "critic/vf_clipfrac": mean_metric((clipped_err > unclipped_err).float(), loss_mask),
        "critic/values": mean_metric(values, loss_mask),
    }


# ---------------------------------------------------------------------------------------------------------------
# Backend-facing callables
# ---------------------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class LossContext:
    """What a per-micro-batch loss needs about its mini-batch; the backend passes it through untouched."""

    config: AlgorithmSettings
    """The algorithm section of the run config."""
    minibatch_loss_tokens: float
    """sum(loss_mask) over the whole mini-batch (all DP ranks, no DP padding): divisor of mean terms."""
    minibatch_num_sequences: int | None = None
    """Rows of the whole mini-batch (no DP padding); needed by the critic's sequence reductions."""

    @classmethod
    def for_minibatch(cls, config: AlgorithmSettings, loss_mask: torch.Tensor) -> "LossContext":
        """Context of a mini-batch from its ``loss_mask [B, R]`` (all rows, before DP padding)."""
        return cls(config=config, minibatch_loss_tokens=float(loss_mask.detach().float().sum()),
                   minibatch_num_sequences=int(loss_mask.shape[0]))


def _get(mb: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | None:
    return mb[key] if key in mb else None


def _require(mb: Mapping[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    if key not in mb:
        raise ValueError(f"the micro-batch has no {key!r}, which {why} needs; add it to the batch")
    return mb[key]


def _token_mean_term(x: torch.Tensor, loss_mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """This micro-batch's share of the mini-batch token mean of ``x [b, R]``."""
    return _masked(x, loss_mask > 0).sum() / max(1.0, float(ctx.minibatch_loss_tokens))


def policy_loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: Mapping[str, torch.Tensor],
                   ctx: LossContext) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Summed policy loss of one micro-batch: policy term + KL (token mean) + distillation's full KL (token mean)
    - entropy bonus (token mean).

    ``mb`` keys: ``loss_mask``, ``advantages`` (already normalized per mini-batch), ``old_logprobs`` (absent:
    the current logprobs, i.e. on-policy), optional ``ref_logprobs`` (needed with ``use_kl_loss``),
    ``rollout_logprobs`` (needed with off-policy correction) and ``DISTILL_KL`` (distillation's full_kl, a
    token-mean term). All ``[b, R]``.
    """
    cfg = ctx.config
    loss_mask = _require(mb, "loss_mask", "every loss")
    old_logprobs = _get(mb, "old_logprobs")
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    loss, metrics = get_policy_loss(cfg.policy_loss_type)(
        logprobs, old_logprobs, _require(mb, "advantages", "the policy loss"), loss_mask, cfg,
        _get(mb, "rollout_logprobs"))
    if cfg.use_kl_loss:
        kl = kl_penalty(logprobs, _require(mb, "ref_logprobs", "algorithm.use_kl_loss=True"), loss_mask,
                        cfg.kl_estimator_type)
        loss = loss + cfg.kl_loss_coef * _token_mean_term(kl, loss_mask, ctx)
        metrics["policy/kl"] = mean_metric(kl, loss_mask)
    if DISTILL_KL in mb:  # weighted already (coef * teacher weight per row); the same token mean as the KL above
        loss = loss + _token_mean_term(mb[DISTILL_KL], loss_mask, ctx)
    if cfg.entropy_loss_coef != 0.0:
        if entropy is None:
            raise ValueError("algorithm.entropy_loss_coef != 0 needs the entropy; call the forward with "
                             "compute_entropy=True")
        loss = loss - cfg.entropy_loss_coef * _token_mean_term(entropy, loss_mask, ctx)
    if entropy is not None:
        metrics["policy/entropy"] = mean_metric(_masked(entropy.detach(), loss_mask > 0), loss_mask)
    metrics["policy/loss"] = Metric(loss, 1.0, "sum")
    return loss, metrics


def value_loss_fn(values: torch.Tensor, entropy: torch.Tensor | None, mb: Mapping[str, torch.Tensor],
                  ctx: LossContext) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Summed critic loss of one micro-batch (same signature shape as ``policy_loss_fn``).

    ``values [b, R]`` are the critic's predictions; ``mb`` keys: ``loss_mask``, ``returns``, ``values`` (the
    rollout-time values). ``entropy`` is ignored. Reduction weights come from ``ctx`` (``loss_reduction`` of
    the config); the advantages are never read or modified.
    """
    cfg = ctx.config
    if ctx.minibatch_num_sequences is None:
        raise ValueError("value_loss_fn needs LossContext.minibatch_num_sequences; build the context with "
                         "LossContext.for_minibatch(config, minibatch_loss_mask)")
    loss_mask = _require(mb, "loss_mask", "the value loss")
    weights = reduction_weights(loss_mask, cfg.loss_reduction, minibatch_tokens=ctx.minibatch_loss_tokens,
                                num_sequences=ctx.minibatch_num_sequences, max_seq_len=cfg.max_seq_len)
    return value_loss(values, _require(mb, "values", "the clipped value loss"),
                      _require(mb, "returns", "the value loss"), loss_mask, weights.to(values.dtype),
                      cfg.value_clip)

