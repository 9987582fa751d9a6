"""Metric partials that aggregate exactly across micro-batches and ranks (docs/STYLE.md habit 5).

A loss or stage returns ``dict[str, Metric]``. Each ``Metric`` is a *partial*: it says how it combines with
other partials of the same name, so averaging over micro-batches of different sizes, or over ranks with
different token counts, gives the same number as computing the metric on the whole mini-batch at once.

    reduce="mean": value = sum of per-item values, count = number of items (tokens or sequences)
                   -> final = sum(value) / max(sum(count), 1)
    reduce="sum":  value summed, count ignored     -> final = sum(value)
    reduce="max" / "min": value combined by max/min -> final = value

Cross-rank reduction (a collective) lives in ``megatron_rl.distributed``; this module is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Reduce = Literal["sum", "mean", "max", "min"]


@dataclass
class Metric:
    value: float
    count: float = 1.0
    reduce: Reduce = "mean"

    def __post_init__(self) -> None:
        if isinstance(self.value, torch.Tensor):
            self.value = float(self.value.detach().float().sum())
        if isinstance(self.count, torch.Tensor):
            self.count = float(self.count.detach().float().sum())
        assert self.reduce in ("sum", "mean", "max", "min"), self.reduce

    def combine(self, other: "Metric") -> "Metric":
        assert self.reduce == other.reduce, (self.reduce, other.reduce)
        if self.reduce in ("max", "min"):  # NaN wins whatever the order (a skipped step must not hide)
            values = (self.value, other.value)
            pick = max if self.reduce == "max" else min
            return Metric(math.nan if any(map(math.isnan, values)) else pick(values), 1.0, self.reduce)
        return Metric(self.value + other.value, self.count + other.count, self.reduce)

    def final(self) -> float:
        if self.reduce == "mean":  # an empty mean (no items) is 0, not NaN
            return self.value / self.count if self.count > 0 else 0.0
        return self.value


def mean_metric(values: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """Masked mean partial over the elements of ``values`` (any shape; ``mask`` same shape)."""
    if mask is None:
        return Metric(values.detach().float().sum(), values.numel(), "mean")
    mask = mask.detach().float()
    return Metric((values.detach().float() * mask).sum(), mask.sum(), "mean")


def merge_metrics(*parts: dict[str, Metric]) -> dict[str, Metric]:
    """Combine metric partials by name; a name missing from some parts is combined over the others."""
    out: dict[str, Metric] = {}
    for part in parts:
        for name, metric in part.items():
            out[name] = out[name].combine(metric) if name in out else metric
    return out


def finalize_metrics(metrics: dict[str, Metric]) -> dict[str, float]:
    """Final float values of combined partials."""
    return {name: metric.final() for name, metric in metrics.items()}
