"""Moved to ``megatron_rl/environments/next_digit/rollout.py``; names re-exported."""

from megatron_rl.environments.next_digit.rollout import (  # noqa: F401
    PlayedEpisode,
    episodes_to_generator_output,
    mean_reward,
    observation_after,
    play_episodes,
)
