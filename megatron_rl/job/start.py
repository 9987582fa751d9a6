"""The main job's start in one process: the pre-flight, then torchrun (``run_megatron.sh``).

``python -m megatron_rl.job.start <pre-flight arguments> --then-torchrun <torchrun arguments>`` runs
``megatron_rl.job.preflight`` (exit 2 and one line when the run cannot start) and, when it passes,
``megatron_rl.distributed.launch`` with the rest. Both import torch; one process pays that once (~2.5 CPU s of a
launch, docs/TESTING.md section 1). Each half can still be run alone as before.
"""

from __future__ import annotations

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
    from megatron_rl.job.preflight import load_job_rl_config
    from megatron_rl.preflight import main as preflight_main

    code = preflight_main(argv[:at], load=load_job_rl_config)
    if code:
        return code
    from megatron_rl.distributed.launch import main as launch_main

    return launch_main(argv[at + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
