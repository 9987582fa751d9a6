"""Pre-flight of the main job: ``megatron_rl.preflight`` with the job's config (library sections + job sections).

``run_megatron.sh`` runs ``python -m megatron_rl.job.preflight --config X --world-size N [key=value ...]`` before
torchrun starts any rank; exit code 2 and one line on stderr when the run cannot start (see the library module).
The environment (prompt files, reward function) is checked by every rank at start-up, before any process group.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from megatron_rl.config import MegatronRLConfig
from megatron_rl.job.config import load_job_config
from megatron_rl.preflight import main as preflight_main


def load_job_rl_config(path: str, overrides: Sequence[str]) -> MegatronRLConfig:
    """The library config of the job (the job's sections are validated on the way, by ``load_job_config``);
    with ``model.hf_path``, its model section is the checkpoint's (``config.json``), so the parallel-size and
    free-space checks see the real shapes (a folder that is not a supported checkpoint: ValueError, exit 2)."""
    rl = load_job_config(path, overrides).rl
    if rl.model.hf_path is None:
        return rl
    from megatron_rl.hf.config import model_config_from_hf

    return dataclasses.replace(rl, model=model_config_from_hf(rl.model.hf_path, base=rl.model))


if __name__ == "__main__":
    sys.exit(preflight_main(load=load_job_rl_config))
