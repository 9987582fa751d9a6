"""Threads per rank (megatron_rl/job/threads.py): derived from the cores the node's ranks and engines leave free,
said on the launcher's first line, OMP_NUM_THREADS wins. Plain Python, < 1 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.job import threads

ROOT = Path(__file__).resolve().parents[2]


def test_the_rule():
    assert threads.threads_per_rank(2, 1) == 2  # one rank on a 2-core machine: both cores (was 1)
    assert threads.threads_per_rank(2, 2) == 1
    assert threads.threads_per_rank(16, 3, reserved=1) == 5
    assert threads.threads_per_rank(2, 4) == 1  # never 0


def test_engines_reserve_cores_only_while_they_run_beside_the_ranks():
    vllm = {"rollout.engine": "vllm", "rollout.num_engines": 3}
    assert threads.engine_cores(vllm, nnodes=1, node=0) == 0  # synchronous: its threads sleep while ranks train
    assert threads.engine_cores({**vllm, "rollout.max_staleness": 1}, nnodes=1, node=0) == 3
    assert threads.engine_cores({**vllm, "rollout.max_staleness": 1}, nnodes=2, node=1) == 1  # 3 engines, 2 nodes
    assert threads.engine_cores({"rollout.max_staleness": 1}, nnodes=1, node=0) == 0  # built-in: the ranks


def test_described_and_overridable(monkeypatch):
    cores = threads.usable_cores()
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.7, 0.0, 0.0))  # a quiet machine
    line = threads.describe(1, {}, env={})
    assert line.startswith(f"{cores} OpenMP thread(s) per rank ({cores} core(s) / 1 rank(s); OMP_NUM_THREADS=N")
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (cores + 5.0, 0.0, 0.0))  # a loaded one: other work
    assert threads.describe(1, {}, env={}).startswith(
        f"1 OpenMP thread(s) per rank ({cores} core(s) less {cores} busy (load average) / 1 rank(s)")
    assert threads.describe(1, {}, env={"OMP_NUM_THREADS": "3"}) == "3 OpenMP thread(s) per rank (OMP_NUM_THREADS)"
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two' is not a positive integer"):
        threads.describe(1, {}, env={"OMP_NUM_THREADS": "two"})


def test_a_small_model_gets_one_thread(monkeypatch, tmp_path):
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.describe(1, {"model.hidden_size": 64}, env={}).startswith(
        "1 OpenMP thread(s) per rank (a model of hidden size 64 < 256")
    (tmp_path / "config.json").write_text('{"text_config": {"hidden_size": 128}}')  # a multimodal checkpoint
    assert threads.hidden_size({"model.hf_path": str(tmp_path)}) == 128
    assert threads.describe(1, {"model.hf_path": str(tmp_path)}, env={}).startswith("1 OpenMP thread(s)")
    assert threads.describe(1, {"model.hidden_size": 1024}, env={}).startswith("4 OpenMP thread(s)")
    assert threads.describe(1, {}, env={}).startswith("4 OpenMP thread(s)")  # size unknown: the cores' rule
    assert threads.describe(1, {"model.hidden_size": 64}, env={"OMP_NUM_THREADS": "2"}).startswith("2 OpenMP")


def test_the_launcher_reads_the_config_and_overrides():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "megatron_rl.job.threads", "1", "--config",
                          str(ROOT / "configs" / "demo_vllm.yaml"), "rollout.max_staleness=1"],
                         capture_output=True, text=True, cwd=ROOT, env=env, check=True).stdout
    assert int(out.split()[0]) >= 1 and "less 1 for the engines" in out  # the busy cores vary with the load
