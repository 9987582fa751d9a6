"""Moved to ``megatron_rl/job/reporting.py``; names re-exported."""

from megatron_rl.job.reporting import (  # noqa: F401
    LOSS_KEY,
    REWARD_KEY,
    RunReporter,
    plot_reward_and_loss,
    read_metrics,
    summary_paragraph,
    truncate_metrics,
    window_mean,
)
