"""Smoke test of bench/bench_moe.py: the MoE-vs-dense benchmark at tiny size (one spawned rank, --quick sizes),
its sanity checks on a real run, and that they fire on broken numbers (BENCHMARKS.md, "Mixture-of-experts")."""

import argparse

import pytest

import bench_moe
from workloads import SanityCheckFailed

QUICK = argparse.Namespace(sequences=4, length=64, layers=2, hidden=64, experts=4, topk=2, moe_ffn=32, reps=1,
                           threads=1, ep2=False, device="cpu", timeout=300.0)  # fmt: skip


def test_active_parameters_of_the_two_models():
    shape = bench_moe.Shape(layers=2, hidden=64, experts=4, topk=2, moe_ffn=32)
    moe, dense = (bench_moe.model_config(shape, kind, 128) for kind in ("moe", "dense"))
    assert dense.ffn_hidden_size == 2 * 32 and dense.num_moe_experts is None
    # two inactive experts per layer, 3 x hidden x moe_ffn each, leave the active count
    assert bench_moe.active_parameters(moe, 1000 + 2 * 4 * 3 * 64 * 32) == 1000 + 2 * 2 * 3 * 64 * 32
    assert bench_moe.active_parameters(dense, 1234) == 1234


@pytest.mark.slow  # spawns one rank
def test_quick_run_reports_both_models():
    result = bench_moe.run(QUICK)
    assert "| 1 rank | moe |" in result["report"] and "| 1 rank | dense |" in result["report"]
    rank = result["layouts"]["1 rank"][0]
    assert rank["moe"]["params"] > rank["dense"]["params"] and rank["moe"]["state_mib"] > rank["dense"]["state_mib"]
    router = QUICK.layers * QUICK.hidden * QUICK.experts
    broken = {**rank, "dense": {**rank["dense"], "active": rank["dense"]["active"] + 1}}
    with pytest.raises(SanityCheckFailed, match="active parameters per token"):
        bench_moe.layout_rows("1 rank", [broken], router)
    nan = {**rank, "moe": {**rank["moe"], "losses": [float("nan")]}}
    with pytest.raises(SanityCheckFailed, match="loss not finite"):
        bench_moe.layout_rows("1 rank", [nan], router)
