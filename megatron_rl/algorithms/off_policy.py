"""Off-policy corrections: importance weights of the sampler's tokens, multiplied into the per-token policy loss.

Place in the data flow: ``losses._finish`` calls ``off_policy_weights`` on every micro-batch and multiplies the
per-token loss by the weights before the masked sum; the trainer calls ``importance_ratio_metrics`` once per
train step on the whole batch (every metrics row of a batch with rollout log-probs, whatever the mode).

The rollouts were sampled by the inference engine (``pi_rollout``: its numerics, and under asynchronous RL
weights up to K versions older than the trainer's), while the PPO-style losses assume samples from ``pi_old``
(the trainer's policy before this step's update, ``old_logprobs``). Per loss token ``t`` of sequence ``i``:

    d_t = clamp(old_t - rollout_t, -20, 20)        log importance ratio, 0 on masked tokens, no gradient
    r_t = exp(d_t)                                  token ratio  pi_old(y_t | y_<t) / pi_rollout(y_t | y_<t)
    rho_i = exp(clamp(sum_t d_t, -20, 20))          sequence ratio  pi_old(y_i) / pi_rollout(y_i)
    gm_i  = exp(sum_t d_t / n_i)                    its geometric mean per token (n_i = loss tokens of i)

Each mode gives a weight per token ``w_t`` (or per sequence ``w_i``, the same for all its tokens), with the cap
``C = tis_cap`` and the band ``[lo, hi] = [is_ratio_low, is_ratio_high]`` (inclusive: a ratio equal to an end is
inside):

    none              w = 1
    token_tis         w_t = min(r_t, C)                              truncated IS, per token
    sequence_tis      w_i = min(rho_i, C)                            truncated IS, per sequence
    token_mask        w_t = r_t  if lo <= r_t <= hi,    else 0       masked IS per token (ICEPOP-style)
    sequence_mis      w_i = rho_i if lo <= rho_i <= hi, else 0       masked IS per sequence
    sequence_mis_geo  w_i = 1    if lo <= gm_i <= hi,  else 0        length-normalized sequence mask

so the policy-gradient estimate becomes ``E_rollout[w * A * grad log pi]``. The masking modes drop the units
whose ratio is outside the band instead of shrinking them (truncation keeps a capped weight, so a token the
sampler and the trainer disagree on still pushes the update; masking removes it), and keep the plain IS weight
inside: ``E_rollout[rho * f] = E_old[f]``, so ``sequence_mis`` is unbiased for the kept sequences and its bias
is only what the mask drops (per token, ``r_t`` makes the same first-order approximation as PPO's token ratio).

``sequence_mis`` uses the SUM of the token log-ratios: ``rho_i`` is the likelihood ratio of the whole sampled
sequence, the only sequence weight that is an importance weight. Its spread grows with the length (a per-token
drift of 0.01 nats over 1,000 tokens is a ratio of e^10), so with long responses a fixed band masks mostly long
sequences. ``sequence_mis_geo`` decides on the per-token geometric mean instead, which is comparable across
lengths, but is not an importance weight, so it only filters: kept sequences have weight 1 (combine it with a
small staleness bound, or prefer ``token_mask``, when the ratios themselves matter).

When to use which: ``token_tis`` for the small, unbiased-on-average numeric mismatch between the sampler and the
trainer (same weights, different kernels); the masking modes for staleness (asynchronous RL: old and rollout
differ by up to K weight versions, and the few tokens far outside the band carry most of the variance);
``sequence_mis`` for sequence-level objectives (GSPO) on short responses, ``sequence_mis_geo`` on long ones.

Contract: weights carry no gradient and are computed per token or per whole sequence (a row of the micro-batch
is a whole sequence), so the loss stays a sum over tokens and the gradient does not depend on how rows are
split into micro-batches or ranks. A sequence whose every token is masked contributes exactly 0 (no NaN: the
per-token loss is finite on loss tokens and the weight is a finite 0).
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.kl import KL_LOG_RATIO_CLAMP, masked_log_ratio
from megatron_rl.algorithms.settings import AlgorithmSettings
from megatron_rl.metrics import Metric, mean_metric

__all__ = ["MASKING_CORRECTIONS", "OFF_POLICY_CORRECTIONS", "TIS_CORRECTIONS", "importance_ratio_metrics",
           "off_policy_weights"]

TIS_CORRECTIONS = ("token_tis", "sequence_tis")
"""Modes that truncate the ratio at ``tis_cap``."""
MASKING_CORRECTIONS = ("token_mask", "sequence_mis", "sequence_mis_geo")
"""Modes that zero the units whose ratio is outside ``[is_ratio_low, is_ratio_high]``."""
OFF_POLICY_CORRECTIONS = ("none",) + TIS_CORRECTIONS + MASKING_CORRECTIONS
"""The valid ``algorithm.off_policy_correction`` modes (formulas in the module docstring)."""


def _check_mode(mode: str, rollout_logprobs: torch.Tensor | None) -> None:
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"algorithm.off_policy_correction={mode!r} is unknown; valid: {sorted(OFF_POLICY_CORRECTIONS)}"
        )
    if rollout_logprobs is None:
        raise ValueError(
            f"algorithm.off_policy_correction={mode!r} needs rollout_logprobs in the batch; have the generator "
            "return logprobs or set off_policy_correction='none'"
        )


def _unit_log_ratios(log_r: torch.Tensor, valid: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log ratio, valid unit)`` per token ``[b, R]`` or per sequence ``[b, 1]`` (sum or mean over tokens)."""
    if mode.startswith("token_"):
        return log_r, valid
    summed = log_r.sum(dim=-1, keepdim=True)  # [b, 1]; masked tokens hold exactly 0
    if mode == "sequence_mis_geo":
        summed = summed / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    return summed.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP), valid.any(dim=-1, keepdim=True)


def _masked_max(x: torch.Tensor, units: torch.Tensor) -> Metric:
    """Max of ``x > 0`` over valid units, 0 when none; kept on the device (no host sync per micro-batch)."""
    return Metric(torch.where(units, x, torch.zeros_like(x)).max().detach() if x.numel() else 0.0, 1.0, "max")


def off_policy_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None, loss_mask: torch.Tensor,
                       config: AlgorithmSettings) -> tuple[torch.Tensor | None, dict[str, Metric]]:
    """Importance weights (no gradient) for ``config.off_policy_correction`` (module docstring).

    Inputs ``[b, R]``. Returns ``(weights [b, R] (token modes) or [b, 1] (sequence modes), metrics)``, or
    ``(None, {})`` for ``none``. Metrics are means over units (loss tokens, or sequences with at least one loss
    token), exact across micro-batches and ranks: ``off_policy/tis_ratio_mean``, ``off_policy/tis_ratio_max``
    and ``off_policy/tis_clipfrac`` for the TIS modes, ``off_policy/masked_frac`` for the masking modes.
    """
    mode = config.off_policy_correction
    if mode == "none":
        return None, {}
    _check_mode(mode, rollout_logprobs)
    valid = loss_mask > 0
    log_r = masked_log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), loss_mask)  # [b, R]
    log_w, units = _unit_log_ratios(log_r, valid, mode)
    ratio = torch.exp(log_w)
    if mode in TIS_CORRECTIONS:
        return ratio.clamp(max=config.tis_cap), {
            "off_policy/tis_ratio_mean": mean_metric(ratio, units),
            "off_policy/tis_ratio_max": _masked_max(ratio, units),
            "off_policy/tis_clipfrac": mean_metric((ratio > config.tis_cap).float(), units),
        }
    inside = (ratio >= config.is_ratio_low) & (ratio <= config.is_ratio_high)
    kept = torch.ones_like(ratio) if mode == "sequence_mis_geo" else ratio
    weights = torch.where(inside, kept, torch.zeros_like(kept))
    return weights, {"off_policy/masked_frac": mean_metric((~inside).float(), units)}


def importance_ratio_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                             loss_mask: torch.Tensor) -> dict[str, Metric]:
    """Statistics of the token ratio ``r_t = exp(old - rollout)`` over the loss tokens of a whole batch ``[B, R]``.

    ``off_policy/ratio_mean`` (a token mean partial), ``off_policy/ratio_min`` and ``off_policy/ratio_max`` (0
    when the batch has no loss token), whatever ``off_policy_correction`` is: how far the sampler is from the
    trainer. Partials on the inputs' device, no host sync (issue 53): min / max count the loss tokens, so a part
    without any is empty (``Metric.combine``) and a batch without any reports 0.
    """
    valid = loss_mask > 0
    ratio = torch.exp(masked_log_ratio(old_logprobs.detach().float(), rollout_logprobs.detach(), loss_mask))
    tokens = valid.sum()
    return {
        "off_policy/ratio_mean": mean_metric(ratio, valid),
        "off_policy/ratio_min": Metric(torch.where(valid, ratio, math.inf).min(), tokens, "min"),
        "off_policy/ratio_max": Metric(torch.where(valid, ratio, -math.inf).max(), tokens, "max"),
    }
