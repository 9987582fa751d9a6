"""Shared builders for the algorithms tests: random right-aligned batches (docs/DESIGN.md section 2)."""

from __future__ import annotations

import torch


def right_aligned_mask(lengths: list[int], width: int) -> torch.Tensor:
    """``[B, width]`` float mask whose row i has ones on its last ``lengths[i]`` columns."""
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        if n:
            mask[i, -n:] = 1.0
    return mask


def random_batch(seed: int, rows: int = 7, width: int = 9, with_empty_row: bool = True) -> dict[str, torch.Tensor]:
    """A random right-aligned batch: response_mask, loss_mask (with holes), logprob-like tensors, advantages.

    Masked positions hold garbage (large values, -inf, nan) that must never leak into losses or gradients.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g).tolist()
    if with_empty_row:
        lengths[rows // 2] = 0
    response_mask = right_aligned_mask(lengths, width)
    holes = (torch.rand(rows, width, generator=g) < 0.2).float()
    loss_mask = response_mask * (1.0 - holes)

    def logp() -> torch.Tensor:
        return -torch.rand(rows, width, generator=g) * 2.0 - 0.05

    batch = {
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "logprobs": logp(),
        "old_logprobs": logp(),
        "ref_logprobs": logp(),
        "rollout_logprobs": logp(),
        "advantages": torch.randn(rows, width, generator=g),
        "entropy": torch.rand(rows, width, generator=g) * 3.0,
    }
    garbage = loss_mask == 0
    batch["old_logprobs"] = torch.where(garbage, torch.full_like(loss_mask, float("-inf")), batch["old_logprobs"])
    batch["ref_logprobs"] = torch.where(garbage, torch.full_like(loss_mask, float("nan")), batch["ref_logprobs"])
    batch["rollout_logprobs"] = torch.where(garbage, torch.full_like(loss_mask, 1e4), batch["rollout_logprobs"])
    return batch
