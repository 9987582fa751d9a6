"""The launcher (``job/start.py``): the device from the config layers as the pre-flight reads them
(``run_megatron.sh`` reads no config itself), and the ranks' gate (``job/gate.py``): they start while the
pre-flight runs and wait for its verdict; a refused run is one line and makes nothing."""

from __future__ import annotations

import os

from tests.support.job_run import ROOT

import subprocess
import threading
import time

import pytest

from megatron_rl.job import gate
from megatron_rl.job.start import configured_device, nproc_per_node, ranks_device


def test_cpu_hides_the_gpus_from_the_ranks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert ranks_device("cpu", 4) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_torchrun_arguments_give_the_ranks_per_node():
    assert nproc_per_node(["--nproc-per-node", "3", "--nnodes", "1"]) == 3
    assert nproc_per_node(["--nproc_per_node=2"]) == 2
    assert nproc_per_node(["--nproc-per-node", "gpu"]) is None and nproc_per_node([]) is None


def test_the_launcher_script_reads_no_yaml():
    script = (ROOT / "run_megatron.sh").read_text()
    assert "sed " not in script and "device:" not in script


def test_the_device_comes_from_the_config_layers():
    demo, user = str(ROOT / "configs" / "demo_cpu.yaml"), str(ROOT / "configs" / "user_job.yaml")
    assert configured_device(["--config", demo, "--world-size", "2"]) == "cpu"
    assert configured_device(["--config", demo, "parallel.device=auto"]) == "auto"
    assert configured_device(["--config", user, "optimizer.lr=1e-5"]) == "auto"  # the schema's default
    assert configured_device(["--config", user, "parallel.device=gpu"]) is None  # the pre-flight says why


@pytest.mark.parametrize("verdict, expected", [(0, None), (2, 0)])
def test_a_rank_waits_for_the_preflight_verdict(tmp_path, monkeypatch, verdict, expected):
    """0 opens the gate (the run goes on, with the variables the launcher set meanwhile, e.g. the engine zygote's
    socket); a refusal makes the rank return 0 at once, saying nothing."""
    path = tmp_path / "verdict"
    monkeypatch.setenv(gate.GATE_ENV, str(path))
    monkeypatch.delenv("MEGATRON_RL_TEST_GATE_VAR", raising=False)
    opener = threading.Timer(0.3, gate.open_gate, args=(path, verdict, {"MEGATRON_RL_TEST_GATE_VAR": "set"}))
    started = time.monotonic()
    opener.start()
    assert gate.wait() == expected
    assert time.monotonic() - started >= 0.25
    assert os.environ.get("MEGATRON_RL_TEST_GATE_VAR") == ("set" if verdict == 0 else None)
    monkeypatch.delenv("MEGATRON_RL_TEST_GATE_VAR", raising=False)
    monkeypatch.delenv(gate.GATE_ENV)
    assert gate.wait() is None  # no launcher gate (plain torchrun, Ray): at once


def test_a_refused_run_starts_its_ranks_but_makes_nothing(tmp_path):
    """Through run_megatron.sh: the ranks start beside the pre-flight; its refusal is its one line, exit 2, no rank
    line, no output folder, no process left."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"),  # the user job without its model: refused
                           f"data.train_files={tmp_path / 'missing.jsonl'}", "reward.function=nothing.py:reward",
                           f"logging.output_dir={out}"],
                          env={**os.environ, "NPROC": "2"}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("base config:")]
    assert len(errors) == 1 and "model.hf_path" in errors[0], proc.stderr
    assert "megatron-core" not in proc.stdout + proc.stderr and not out.exists()
