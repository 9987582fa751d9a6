"""Metric partials: combining in any order equals computing on the whole; NaN is never hidden."""

import math
import random

import pytest
import torch

from megatron_rl.metrics import Metric, finalize_metrics, mean_metric, merge_metrics


def test_split_means_equal_the_whole_mean():
    values, mask = torch.randn(7, 5), (torch.rand(7, 5) > 0.4).float()
    whole = mean_metric(values, mask).final()
    parts = [mean_metric(values[a:b], mask[a:b]) for a, b in ((0, 1), (1, 4), (4, 7))]
    merged = merge_metrics(*({"m": p} for p in parts))["m"].final()
    assert merged == pytest.approx(whole, rel=1e-6, abs=1e-6)  # fp32 sums of +-1 values: the mean can be near 0
    assert whole == pytest.approx(float((values * mask).sum() / mask.sum()), rel=1e-6)


def test_empty_mean_is_zero_and_fractional_weights_divide():
    assert mean_metric(torch.ones(3), torch.zeros(3)).final() == 0.0
    assert mean_metric(torch.tensor([4.0]), torch.tensor([0.5])).final() == pytest.approx(4.0)


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_nan_wins_in_max_and_min_whatever_the_order(reduce):
    parts = [Metric(1.0, 1.0, reduce), Metric(math.nan, 1.0, reduce), Metric(2.0, 1.0, reduce)]
    for _ in range(4):
        random.shuffle(parts)
        assert math.isnan(merge_metrics(*({"x": p} for p in parts))["x"].final())


def test_sum_and_finalize():
    out = finalize_metrics(merge_metrics({"s": Metric(2.0, 1.0, "sum")}, {"s": Metric(3.0, 1.0, "sum")}))
    assert out == {"s": 5.0}


def test_metrics_to_host_keeps_order_and_values():
    """Device partials (here CPU tensors set after construction, as a CUDA loss leaves them) become floats in
    one copy, each back in its own place; float partials pass through."""
    from megatron_rl.metrics import metrics_to_host

    a, b = Metric(0.0, 1.0, "mean"), Metric(0.0, 1.0, "max")
    a.value, a.count, b.value = torch.tensor(6.0), torch.tensor(3.0), torch.tensor(-1.5)
    parts = [{"a": a, "b": b}, {"a": Metric(4.0, 1.0, "mean")}]
    host = metrics_to_host(parts)
    assert all(m.on_host() for part in host for m in part.values())
    assert [(m.value, m.count) for part in host for m in part.values()] == [(6.0, 3.0), (-1.5, 1.0), (4.0, 1.0)]
    assert finalize_metrics(merge_metrics(*host)) == {"a": 2.5, "b": -1.5}
    plain = [{"a": Metric(1.0)}]
    assert metrics_to_host(plain) is plain
    assert isinstance(Metric(torch.tensor([1.0, 2.0])).value, float)  # CPU tensors convert at construction


def test_an_empty_max_or_min_partial_adds_nothing():
    """A micro-batch without loss tokens reports its ratio min / max with count 0 (no host sync to skip it)."""
    parts = [{"lo": Metric(math.inf, 0.0, "min"), "hi": Metric(-math.inf, 0.0, "max")},
             {"lo": Metric(0.5, 3.0, "min"), "hi": Metric(2.0, 3.0, "max")},
             {"lo": Metric(math.inf, 0.0, "min"), "hi": Metric(-math.inf, 0.0, "max")}]
    assert finalize_metrics(merge_metrics(*parts)) == {"lo": 0.5, "hi": 2.0}
    assert finalize_metrics(merge_metrics(parts[0], parts[2])) == {"lo": 0.0, "hi": 0.0}  # no token at all: 0
    assert math.isnan(Metric(math.nan, 1.0, "max").combine(Metric(2.0, 1.0, "max")).final())  # NaN still wins
