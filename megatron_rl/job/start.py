"""The main job's start in one process: the device, then torchrun, with the pre-flight beside it (``run_megatron.sh``).

``python -m megatron_rl.job.start <pre-flight arguments> --then-torchrun <torchrun arguments>`` reads
``parallel.device`` from the config layers (YAML only, as ``job/threads.py``; ``ranks_device``: cpu hides the GPUs
from the ranks), starts torchrun through ``megatron_rl.distributed.launch``, and runs ``megatron_rl.job.preflight``
in a thread meanwhile: the ranks import torch while the pre-flight checks (~2 s each, one after the other before),
then wait for its verdict (``job/gate.py``) before they read the config or make anything. A refused run is the
pre-flight's one line and exit code 2; its ranks return 0 without a word. Where the config layers do not read,
the pre-flight runs first and says why (``_sequential``). Both halves import torch; one process pays that once.
Each half can still be run alone as before.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from megatron_rl.job.gate import GATE_ENV, open_gate

SEPARATOR = "--then-torchrun"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if SEPARATOR not in argv:
        print(f"megatron_rl.job.start: usage: <pre-flight arguments> {SEPARATOR} <torchrun arguments>",
              file=sys.stderr)
        return 2
    at = argv.index(SEPARATOR)
    torchrun = argv[at + 1:]
    device = configured_device(argv[:at])
    if device is None:  # the config files do not read: the pre-flight says why, before torchrun
        return _sequential(argv[:at], torchrun)
    code = ranks_device(device, nproc_per_node(torchrun))
    if code:
        return code
    from megatron_rl.distributed.launch import main as launch_main

    preflight = _Preflight(argv[:at])
    with tempfile.TemporaryDirectory(prefix="megatron_rl-gate-") as tmp:
        os.environ[GATE_ENV] = str(Path(tmp) / "verdict")  # the ranks inherit it (job/gate.py)
        thread = threading.Thread(target=preflight.run, args=(os.environ[GATE_ENV],), daemon=True)
        thread.start()
        try:
            code = launch_main(torchrun)
        finally:
            thread.join()
            if preflight.zygote is not None:
                preflight.zygote.stop()
    return preflight.code or code


class _Preflight:
    """The pre-flight in a thread of the launcher while torchrun starts the ranks (``job/gate.py``): its verdict
    opens or closes the ranks' gate; a vLLM run's engine zygote starts once it passed."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv, self.code, self.zygote = list(argv), 2, None

    def run(self, gate: str) -> None:
        before = dict(os.environ)
        try:
            code, jobs = _preflight(self.argv)
            if not code and jobs and jobs[-1].rollout.engine == "vllm":  # CPU engines forked from a zygote
                from megatron_rl.inference.vllm.job_zygote import start_for  # importing vLLM meanwhile

                self.zygote = start_for(jobs[-1])  # its socket in $MEGATRON_RL_ENGINE_ZYGOTE, for the ranks
            self.code = code
        finally:  # an unexpected error (its traceback is the thread's) closes the gate too: code 2
            set_here = {k: v for k, v in os.environ.items() if before.get(k) != v}
            open_gate(gate, self.code, set_here)


def _preflight(argv: Sequence[str]) -> tuple[int, list]:
    """The pre-flight's exit code, and the job configs it loaded."""
    from functools import partial

    from megatron_rl.job.preflight import load_job_rl_config
    from megatron_rl.preflight import run as preflight

    jobs: list = []
    code, _ = preflight(argv, load=partial(load_job_rl_config, keep=jobs))
    return code, jobs


def _sequential(argv: Sequence[str], torchrun: Sequence[str]) -> int:
    """The pre-flight, then torchrun (no gate): where the device cannot be read before the pre-flight."""
    code, jobs = _preflight(argv)
    if code:
        return code
    code = ranks_device(jobs[-1].rl.parallel.device if jobs else "auto", nproc_per_node(torchrun))
    if code:
        return code
    from megatron_rl.distributed.launch import main as launch_main

    return launch_main(torchrun)


def configured_device(argv: Sequence[str]) -> str | None:
    """``parallel.device`` of the pre-flight arguments' config layers and overrides (YAML only, as
    ``job/threads.py`` reads them), its default when unset; None when they cannot be read."""
    from megatron_rl.config import ParallelConfig
    from megatron_rl.config_files import ConfigError, config_arguments, read_overrides

    try:
        device = read_overrides(*config_arguments(argv)).get("parallel.device", ParallelConfig.device)
    except (ConfigError, ValueError, OSError):
        return None
    return device if device in ("auto", "cuda", "cpu") else None


def ranks_device(device: str, nproc: int | None) -> int:
    """``parallel.device`` (docs/DESIGN.md section 11) for the ranks this launcher starts: cpu hides the GPUs
    from them (``CUDA_VISIBLE_DEVICES=""``, inherited); otherwise NCCL needs one visible GPU per rank, so more
    ranks per node than GPUs is a usage error (one line, exit code 2) before torchrun starts.
    ``distributed/bootstrap.py`` applies and checks the device again in every rank."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return 0
    import torch

    gpus = torch.cuda.device_count()
    if gpus > 0 and nproc is not None and nproc > gpus:
        print(f"run_megatron.sh: NPROC={nproc} ranks but {gpus} visible CUDA GPU(s), and NCCL needs one GPU per rank: "
              f"use NPROC={gpus} (e.g. NPROC=1 CONFIG=configs/demo_gpu.yaml), or run the ranks on CPU with gloo by "
              "adding the override parallel.device=cpu", file=sys.stderr, flush=True)
        return 2
    return 0


def nproc_per_node(torchrun: Sequence[str]) -> int | None:
    """torchrun's ``--nproc-per-node`` (or ``--nproc_per_node``) as a number; None when absent or not a number
    (e.g. 'gpu')."""
    value = None
    for i, arg in enumerate(torchrun):
        name, _, inline = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = inline or (torchrun[i + 1] if i + 1 < len(torchrun) else None)
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
