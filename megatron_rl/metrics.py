"""Metric partials that aggregate exactly across micro-batches and ranks (docs/STYLE.md habit 5).

A loss or stage returns ``dict[str, Metric]``. Each ``Metric`` is a *partial*: it says how it combines with
other partials of the same name, so averaging over micro-batches of different sizes, or over ranks with
different token counts, gives the same number as computing the metric on the whole mini-batch at once.

    reduce="mean": value = sum of per-item values, count = number of items (tokens or sequences)
                   -> final = sum(value) / max(sum(count), 1)
    reduce="sum":  value summed, count ignored     -> final = sum(value)
    reduce="max" / "min": value combined by max/min -> final = value

Device contract (docs/DESIGN.md section 11): a final metric is a Python float. A partial built from a CPU tensor
is converted at once; one built from a device tensor (a loss on CUDA) keeps a detached 0-d device tensor until
``metrics_to_host`` moves every partial of a call to the host in one copy, so a step pays one device sync for
its metrics, not one per metric and micro-batch. ``final()`` and max/min combining always work on floats.

Cross-rank reduction (a collective) lives in ``megatron_rl.distributed``; this module is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Reduce = Literal["sum", "mean", "max", "min"]


def _partial(x: float | torch.Tensor) -> float | torch.Tensor:
    """A float, or (for a tensor on a device other than the CPU) its detached fp32 sum left on that device."""
    if not isinstance(x, torch.Tensor):
        return x
    total = x.detach().float().sum()
    return float(total) if total.device.type == "cpu" else total


@dataclass
class Metric:
    value: float
    """A float; a 0-d device tensor only between a device loss and ``metrics_to_host`` (module docstring)."""
    count: float = 1.0
    reduce: Reduce = "mean"

    def __post_init__(self) -> None:
        self.value = _partial(self.value)
        self.count = _partial(self.count)
        assert self.reduce in ("sum", "mean", "max", "min"), self.reduce

    def on_host(self) -> bool:
        return not isinstance(self.value, torch.Tensor) and not isinstance(self.count, torch.Tensor)

    def combine(self, other: "Metric") -> "Metric":
        assert self.reduce == other.reduce, (self.reduce, other.reduce)
        if self.reduce in ("max", "min"):  # NaN wins whatever the order (a skipped step must not hide)
            if float(self.count) == 0 or float(other.count) == 0:  # an empty partial (no item) adds nothing
                return other if float(self.count) == 0 else self
            values = (float(self.value), float(other.value))
            pick = max if self.reduce == "max" else min
            return Metric(math.nan if any(map(math.isnan, values)) else pick(values), 1.0, self.reduce)
        return Metric(self.value + other.value, self.count + other.count, self.reduce)

    def final(self) -> float:
        value, count = float(self.value), float(self.count)
        if self.reduce == "mean":  # an empty mean (no items) is 0, not NaN
            return value / count if count > 0 else 0.0
        return value if count != 0 else 0.0  # an empty max / min (count 0, e.g. no loss token) is 0


def metrics_to_host(parts: list[dict[str, Metric]]) -> list[dict[str, Metric]]:
    """The same partials with every device tensor turned into a float: one copy per device for all of them."""
    pending: dict[torch.device, list[torch.Tensor]] = {}
    for part in parts:
        for metric in part.values():
            for x in (metric.value, metric.count):
                if isinstance(x, torch.Tensor):
                    pending.setdefault(x.device, []).append(x)
    if not pending:
        return parts
    floats = {dev: iter(torch.stack(xs).cpu().tolist()) for dev, xs in pending.items()}  # [n] -> host, once

    def host(x: float | torch.Tensor) -> float:
        return next(floats[x.device]) if isinstance(x, torch.Tensor) else x

    # The same traversal order as above, so each float goes back where its tensor was.
    return [{name: Metric(host(m.value), host(m.count), m.reduce) for name, m in part.items()} for part in parts]


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
