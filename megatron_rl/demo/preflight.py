"""Pre-flight of the main job: ``megatron_rl.preflight`` with the job's config (library sections + ``demo``).

``run_megatron.sh`` runs ``python -m megatron_rl.demo.preflight --config X --world-size N [key=value ...]`` before
torchrun starts any rank; exit code 2 and one line on stderr when the run cannot start (see the library module).
"""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_rl.config import MegatronRLConfig
from megatron_rl.demo.config import load_demo_config
from megatron_rl.preflight import main as preflight_main


def load_job_config(path: str, overrides: Sequence[str]) -> MegatronRLConfig:
    """The library config of the job (``demo`` is validated on the way, by ``load_demo_config``)."""
    return load_demo_config(path, overrides).rl


if __name__ == "__main__":
    sys.exit(preflight_main(load=load_job_config))
