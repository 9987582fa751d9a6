"""Moved to ``megatron_rl/job/main.py`` (the generic main job); ``python -m megatron_rl.demo.main`` still runs it."""

import sys

from megatron_rl.job.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
