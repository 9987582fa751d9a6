"""The main job's start in one process: the pre-flight, the device, then torchrun (``run_megatron.sh``).

``python -m megatron_rl.job.start <pre-flight arguments> --then-torchrun <torchrun arguments>`` runs
``megatron_rl.job.preflight`` (exit 2 and one line when the run cannot start) and, when it passes, applies
``parallel.device`` of the config the pre-flight resolved (``ranks_device``: the launcher reads no YAML of its
own), then ``megatron_rl.distributed.launch`` with the rest. Both import torch; one process pays that once (~2.5
CPU s of a launch, docs/TESTING.md section 1). Each half can still be run alone as before.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

SEPARATOR = "--then-torchrun"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if SEPARATOR not in argv:
        print(f"megatron_rl.job.start: usage: <pre-flight arguments> {SEPARATOR} <torchrun arguments>",
              file=sys.stderr)
        return 2
    at = argv.index(SEPARATOR)
    from functools import partial

    from megatron_rl.job.preflight import load_job_rl_config
    from megatron_rl.preflight import run as preflight

    jobs: list = []
    code, config = preflight(argv[:at], load=partial(load_job_rl_config, keep=jobs))
    if code:
        return code
    torchrun = argv[at + 1:]
    code = ranks_device(config.parallel.device, nproc_per_node(torchrun))
    if code:
        return code
    from megatron_rl.distributed.launch import main as launch_main

    zygote = None
    if jobs and jobs[-1].rollout.engine == "vllm":  # CPU engines forked from a zygote importing vLLM meanwhile
        from megatron_rl.inference.vllm.job_zygote import start_for

        zygote = start_for(jobs[-1])
    try:
        return launch_main(torchrun)
    finally:
        if zygote is not None:
            zygote.stop()


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
