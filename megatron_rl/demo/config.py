"""Moved to ``megatron_rl/job/config.py`` (the main job's config); the old names are kept for callers."""

from megatron_rl.job.config import (  # noqa: F401
    JobConfig as DemoJobConfig,
    MOVED_KEYS,
    check_demo_config,
    dump_job_config as dump_demo_config,
    load_job_config as load_demo_config,
)
