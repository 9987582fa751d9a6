"""Moved to ``megatron_rl/job/preflight.py``; ``python -m megatron_rl.demo.preflight`` still runs it."""

import sys

from megatron_rl.job.preflight import load_job_rl_config as load_job_config
from megatron_rl.preflight import main as preflight_main

__all__ = ["load_job_config"]

if __name__ == "__main__":
    sys.exit(preflight_main(load=load_job_config))
