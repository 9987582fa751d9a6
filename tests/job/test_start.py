"""The launcher takes the device from the config the pre-flight resolved (``job/start.py``), not from the YAML
text: ``run_megatron.sh`` reads no config itself. Cheap (no torch import for cpu)."""

from __future__ import annotations

import os

from tests.support.job_run import ROOT

from megatron_rl.job.start import nproc_per_node, ranks_device


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
