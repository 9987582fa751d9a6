"""Loss reduction through the advantages (docs/DESIGN.md section 5).

Place in the data flow: after ``compute_advantages_and_returns`` (whole batch) and before the mini-batch is
padded for data parallelism and cut into micro-batches:

    advantages [B, R] --(optional whole-batch whitening)--> per mini-batch: A * reduction weight --> losses

The policy loss is a masked SUM of per-token terms that are linear in the advantages, so scaling the
advantages by a per-row weight ``w_i`` computed over the whole mini-batch makes the mini-batch gradient the
gradient of one global sum, whatever the micro-batch / data-parallel split:

    token_mean               w_i = 1 / max(1, sum(loss_mask over the mini-batch))
    sequence_mean            w_i = 1 / (num_sequences * max(1, sum_t loss_mask[i]))
    seq_mean_token_sum_norm  w_i = 1 / (num_sequences * max_seq_len)                  (Dr. GRPO)

``num_sequences`` counts the mini-batch rows before DP padding. Denominators are clamped to >= 1 so an
all-masked mini-batch gives finite zeros. The same weights serve the critic (``value_loss_fn`` computes them
from ``LossContext``), so the critic never re-normalizes the advantages: only the policy path calls
``normalize_advantages_per_minibatch``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


ReductionWeightFn = Callable[[torch.Tensor, float, float, "int | None"], torch.Tensor]
"""fn(row_tokens [B, 1], minibatch_tokens, num_sequences, max_seq_len) -> weights broadcastable to [B, 1]."""


def _token_mean(row_tokens: torch.Tensor, minibatch_tokens: float, num_sequences: float,
                max_seq_len: int | None) -> torch.Tensor:
    return torch.full_like(row_tokens, 1.0 / max(1.0, float(minibatch_tokens)))


def _sequence_mean(row_tokens: torch.Tensor, minibatch_tokens: float, num_sequences: float,
                   max_seq_len: int | None) -> torch.Tensor:
    return 1.0 / (max(1.0, float(num_sequences)) * row_tokens.clamp(min=1.0))


def _seq_mean_token_sum_norm(row_tokens: torch.Tensor, minibatch_tokens: float, num_sequences: float,
                             max_seq_len: int | None) -> torch.Tensor:
    if max_seq_len is None or max_seq_len <= 0:
        raise ValueError(
            f"loss_reduction='seq_mean_token_sum_norm' needs a positive max_seq_len (got {max_seq_len!r}); "
            "set algorithm.max_seq_len to the generation budget"
        )
    return torch.full_like(row_tokens, 1.0 / (max(1.0, float(num_sequences)) * float(max_seq_len)))


LOSS_REDUCTION_WEIGHTS: dict[str, ReductionWeightFn] = {
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}
"""Registry of loss reductions (``algorithm.loss_reduction``): name -> per-row weight function."""

LOSS_REDUCTIONS: tuple[str, ...] = tuple(LOSS_REDUCTION_WEIGHTS)
"""The valid ``algorithm.loss_reduction`` names."""


def reduction_weights(loss_mask: torch.Tensor, loss_reduction: str, *, minibatch_tokens: float,
                      num_sequences: float, max_seq_len: int | None = None) -> torch.Tensor:
    """Per-row weights ``[b, 1]`` (fp32) of ``loss_reduction`` for rows ``loss_mask [b, R]`` of a mini-batch.

    ``minibatch_tokens`` and ``num_sequences`` describe the whole mini-batch (all DP ranks, no DP padding),
    so a micro-batch can compute its rows' weights locally.
    """
    if loss_reduction not in LOSS_REDUCTION_WEIGHTS:
        raise ValueError(
            f"loss_reduction={loss_reduction!r} is unknown; valid: {sorted(LOSS_REDUCTION_WEIGHTS)} "
            "(set algorithm.loss_reduction)"
        )
    row_tokens = loss_mask.detach().float().sum(dim=-1, keepdim=True)  # [b, 1]
    return LOSS_REDUCTION_WEIGHTS[loss_reduction](row_tokens, minibatch_tokens, num_sequences, max_seq_len)


def normalize_minibatch_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, loss_reduction: str,
                                   max_seq_len: int | None = None) -> torch.Tensor:
    """Scale the advantages ``[B, R]`` of ONE mini-batch (all DP ranks' rows, before DP padding).

    Returns a new ``[B, R]`` tensor ``A * w`` (see the module docstring for ``w``); masked positions keep
    ``A * w`` too (the losses mask them). Raises ValueError for an unknown ``loss_reduction`` or a missing
    ``max_seq_len`` with ``seq_mean_token_sum_norm``.
    """
    if advantages.shape != loss_mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and loss_mask {tuple(loss_mask.shape)} must have "
                         "the same [B, R] shape (one mini-batch, right-aligned)")
    weights = reduction_weights(
        loss_mask, loss_reduction, minibatch_tokens=float(loss_mask.detach().float().sum()),
        num_sequences=advantages.shape[0], max_seq_len=max_seq_len,
    )
    return advantages * weights.to(advantages.dtype)


def normalize_advantages_per_minibatch(advantages: torch.Tensor, loss_mask: torch.Tensor,
                                       boundaries: Sequence[tuple[int, int]], loss_reduction: str,
                                       max_seq_len: int | None = None) -> torch.Tensor:
    """Apply ``normalize_minibatch_advantages`` to each ``(start, end)`` row range of the batch ``[B, R]``.

    ``boundaries`` come from ``compute_prompt_mini_batch_boundaries`` (whole prompts per mini-batch); they must
    tile ``[0, B)`` in order. Policy only: the critic path never calls this.
    """
    expected_start = 0
    out = advantages.clone()
    for start, end in boundaries:
        if start != expected_start or end <= start:
            raise ValueError(
                f"mini-batch boundaries {list(boundaries)} must tile [0, {advantages.shape[0]}) in order "
                "with non-empty ranges; build them with compute_prompt_mini_batch_boundaries"
            )
        out[start:end] = normalize_minibatch_advantages(
            advantages[start:end], loss_mask[start:end], loss_reduction, max_seq_len)
        expected_start = end
    if expected_start != advantages.shape[0]:
        raise ValueError(
            f"mini-batch boundaries {list(boundaries)} end at row {expected_start} but the batch has "
            f"{advantages.shape[0]} rows; boundaries must cover the whole batch"
        )
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (same shape); 0 where the mask is empty (never NaN)."""
    mask = mask.to(x.dtype)
    x = torch.where(mask > 0, x, torch.zeros_like(x))
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whole-batch whitening ``(A - mean) / sqrt(var + eps)`` over ``mask`` (``[B, R]``); zero where masked.

    Mean and (Bessel-corrected) variance are over the masked tokens of the whole batch; with fewer than two
    valid tokens every centered value is 0, so the result is all zeros (never NaN). This is the
    ``algorithm.advantage_whitening`` switch, applied once per batch, before the per-mini-batch reduction
    weights.
    """
    valid = mask > 0
    n = valid.sum()
    mean = masked_mean(advantages, mask)
    centered = torch.where(valid, advantages - mean, torch.zeros_like(advantages))
    var = (centered ** 2).sum() / (n - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)
