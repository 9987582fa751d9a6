"""Pre-flight of the main job: ``megatron_rl.preflight`` with the job's config (library sections + job sections),
plus a quick look at the task.

``run_megatron.sh`` runs ``python -m megatron_rl.job.preflight --config X --world-size N [key=value ...]`` before
torchrun starts any rank; exit code 2 and one line on stderr when the run cannot start (see the library module).
The environment is built once here on the first ``PREFLIGHT_ROWS`` rows of each data file: the files are read,
the prompt column and the chat template resolved, the reward function imported and called on the first row, so
these mistakes come in the pre-flight (seconds, mostly imports), before any rank starts (every rank builds it
again on all the rows). The distillation teachers' checkpoints are checked here too (``check_teachers``: readable,
vocabulary and tokenizer the student's; files only).
"""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_rl.config import MegatronRLConfig
from megatron_rl.job.config import load_job_config
from megatron_rl.preflight import main as preflight_main

PREFLIGHT_ROWS = 64
"""Rows of each data file the pre-flight reads."""


def load_job_rl_config(path: str | list[str], overrides: Sequence[str], *,
                       keep: list | None = None) -> MegatronRLConfig:
    """The library config of the job (the job's sections are validated on the way, by ``load_job_config``, and
    the environment is built on the first rows of its data: ConfigError naming the key); with
    ``model.hf_path``, its model section is the checkpoint's (``config.json``, resolved once by
    ``load_job_config``), so the parallel-size and free-space checks see the real shapes (a folder that is not a
    supported checkpoint: ConfigError naming ``model.hf_path``, exit 2)."""
    from megatron_rl.distillation.teachers import check_teachers
    from megatron_rl.environments.registry import make_environment

    config = load_job_config(path, overrides)
    make_environment(config, max_rows=PREFLIGHT_ROWS)
    check_teachers(config.rl)  # files only: a teacher of another vocabulary stops the run here, not in the ranks
    if keep is not None:  # the launcher's copy of the whole job config (job/start.py)
        keep.append(config)
    return config.rl


if __name__ == "__main__":
    sys.exit(preflight_main(load=load_job_rl_config))
