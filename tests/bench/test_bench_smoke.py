"""Smoke test of the benchmarks in bench/: each core function at a tiny size, with its own sanity checks.

The real benchmarks are not tests (BENCHMARKS.md). Here: the token counts are pinned to a loop reference, the
sanity checks must pass on real runs and must fire on broken numbers, and ``main`` turns a failed check into a
non-zero exit. One process, one model build per benchmark (seconds in total).
"""

import sys
from pathlib import Path

import pytest
import torch

import bench_preprocess
import bench_scaling
import bench_throughput
import bench_tokens
from workloads import (
    IndependentSpec,
    SanityCheckFailed,
    StepWiseSpec,
    independent_workload,
    stepwise_workload,
    unique_tokens,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank_megatron():
    """The model benchmarks initialize megatron once per process; tear it down for the other test modules."""
    torch.set_num_threads(1)
    yield
    if bench_throughput._GROUPS:
        from megatron_rl.distributed.bootstrap import destroy_distributed

        destroy_distributed()
        bench_throughput._GROUPS.clear()


def _reference_layouts(out, alignments):
    """Token slots of each layout by a plain loop over the rows."""
    prompts, responses = out["prompt_token_ids"], out["response_ids"]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    counts = {
        "real": sum(lengths),
        "two-segment": len(lengths) * (max(len(p) for p in prompts) + max(len(r) for r in responses)),
        "unified": len(lengths) * max(lengths),
    }
    for align in alignments:
        counts[f"packed tp={align}"] = sum(-(-n // align) * align for n in lengths)
    return counts


def test_layout_tokens_match_loop_reference():
    for out in (stepwise_workload(StepWiseSpec(num_trajectories=4, turns=3)),
                independent_workload(IndependentSpec(num_sequences=12, mean_len=96, jitter=30))):  # fmt: skip
        assert bench_tokens.layout_tokens(out, (1, 2, 8)) == _reference_layouts(out, (1, 2, 8))


def test_stepwise_workload_shapes():
    spec = StepWiseSpec(num_trajectories=4, turns=3, samples_per_prompt=2)
    out = stepwise_workload(spec)
    assert len(out["uids"]) == 12 and out["uids"][:6] == [0] * 6
    for t in range(1, 3):  # each prompt extends the previous prompt + response (mergeable)
        prev = out["prompt_token_ids"][t - 1] + out["response_ids"][t - 1]
        assert out["prompt_token_ids"][t][: len(prev)] == prev
    assert unique_tokens(out) == sum(len(out["prompt_token_ids"][i]) + len(out["response_ids"][i]) for i in (2, 5, 8, 11))


def test_bench_tokens_quick():
    result = bench_tokens.run(8, 4, 16, quick=True)
    assert result["merged"]["real"] < result["stepwise"]["real"]
    assert [r["turns"] for r in result["sweep"]] == [1, 2, 4]


def test_sanity_checks_fire():
    with pytest.raises(SanityCheckFailed, match="below the real count"):
        bench_tokens.check_layouts({"real": 10, "two-segment": 20, "unified": 12, "packed tp=1": 10,
                                    "packed tp=2": 9, "packed tp=8": 16})  # fmt: skip
    with pytest.raises(SanityCheckFailed, match="loss"):
        bench_throughput.check_same_training({"padded": (1.0, 1.0), "packed": (1.1, 1.0)})


def test_main_exits_nonzero_on_failed_check(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise SanityCheckFailed("merged tokens above unmerged")

    monkeypatch.setattr(bench_tokens, "run", broken)
    monkeypatch.setattr(sys, "argv", ["bench_tokens.py", "--quick"])
    with pytest.raises(SystemExit) as exit_info:
        bench_tokens.main()
    assert exit_info.value.code == 1
    assert "SANITY CHECK FAILED" in capsys.readouterr().err


def test_bench_throughput_quick():
    result = bench_throughput.run(4, 2, reps=1, warmup=0)
    assert set(result["times"]) == set(bench_throughput.VARIANTS)
    slots = result["slots"]
    assert slots["merged+packed"] < slots["packed"] < slots["padded"]


def test_peak_step_memory_in_process():
    out = bench_throughput.workload(1, 1)
    model = bench_throughput.build_model(bench_throughput.tiny_model_config())
    mib, method = bench_throughput.peak_step_memory(model, bench_throughput.variant_inputs(out)["packed"])
    assert method in ("VmHWM", "ru_maxrss") and mib >= 0


def test_bench_preprocess_quick():
    result = bench_preprocess.run(8, 4, mini_batch_prompts=1, max_tokens=2048, reps=1, sample=1)
    assert [r["pipeline"] for r in result["rows"]] == ["rows", "merged"]
    assert all(r["step"].wall > 0 and r["fraction"] > 0 and r["cpu_fraction"] > 0 for r in result["rows"])


def test_bench_scaling_quick(tmp_path):
    bench_scaling.run(256, 1, 1, tmp_path, lengths=(128, 256), turns=(1, 2))
    assert {p.name for p in tmp_path.iterdir()} == {"scaling.md", "scaling.json", "scaling.png"}


def _run_small_on_the_engine(script: str, tmp_path: Path):
    """``bench/<script> --small`` on the real engine (skips, or fails under MEGATRON_RL_REQUIRE_ENGINE=1, without
    it); asserts it exits 0 and returns the process and its ``--out`` file."""
    import os
    import subprocess

    from tests.support.engine_env import engine_python

    out = tmp_path / "out.json"
    env = {**os.environ, "MEGATRON_RL_ENGINE_PYTHON": engine_python()}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / script), "--small", "--out", str(out),
         "--model-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


@pytest.mark.engine
def test_bench_weight_sync_small(tmp_path):
    """``bench_weight_sync.py --small`` end to end: the real engine, one sync of the tiny model (~2 min here)."""
    import json

    proc, out = _run_small_on_the_engine("bench_weight_sync.py", tmp_path)
    (row,) = json.loads(out.read_text())["rows"]
    (bucket,) = row["buckets"]
    assert row["model"] == "tiny" and row["layout"] == "tp1"
    assert bucket["tensors"] == 2 * 11 + 3 and bucket["sync_s"] > 0 and bucket["raw_mb_s"] > 0
    assert row["disk"]["sync_s"] > 0
    assert "| tiny | tp1 |" in proc.stdout


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.fleet
def test_bench_fleet_small(tmp_path):
    """``bench_fleet.py --small`` end to end: a real fleet of 2 engines (also with engine 0 alone), the tiny
    model, 8 prompts x 8 tokens, and the latency paths (~2-3 min here)."""
    import json

    proc, out = _run_small_on_the_engine("bench_fleet.py", tmp_path)
    (res,) = json.loads(out.read_text())["results"]
    rows = {r["engines_serving"]: r for r in res["throughput"]}
    assert set(rows) == {1, 2} and all(r["tok_s"] > 0 and r["max_tokens"] == 8 for r in rows.values())
    assert rows[2]["per_engine"] == {"0": 4, "1": 4}  # 8 distinct prompts: the router splits them evenly
    assert set(res["latency"]) == {"raw http.client, new connection", "raw http.client, keep-alive",
                                   "EngineServer.complete", "Fleet.generate (1 prompt)"}
    assert all(v["median_ms"] > 0 for v in res["latency"].values())
    assert all(f >= 0.9 for f in res["same_samples_fraction"].values())
    assert "| tiny | 2 | 1 | 8 x 8 |" in proc.stdout


def test_bench_async_summary_and_its_staleness_check():
    """``bench_async.summarize``: medians after the warm-up; the staleness check fires when the schedule is off."""
    import bench_async

    def row(step_s: float, stale: float) -> dict:
        return {"timing/step_s": step_s, "timing/rollout_s": 0.5, "timing/rollout_wait_s": 0.1,
                "timing/weight_sync_s": 0.05, "rollout/staleness_mean": stale}

    rows = [row(9.0, 0)] * bench_async.WARMUP + [row(1.0, 1), row(2.0, 1), row(3.0, 1)]
    result = bench_async.summarize(rows, 1)
    assert result["step_s"] == 2.0 and result["wait_s"] == 0.1 and result["train_s"] == pytest.approx(1.85)
    with pytest.raises(bench_async.SanityCheckFailed):
        bench_async.summarize(rows, 2)
    partial = rows[:-1] + [row(3.0, 0.4)]
    assert bench_async.summarize(partial, 1, partial=True)["staleness"] == pytest.approx(0.8)
    with pytest.raises(bench_async.SanityCheckFailed):
        bench_async.summarize(partial, 1)
