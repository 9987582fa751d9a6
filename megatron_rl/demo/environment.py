"""Moved to ``megatron_rl/environments/next_digit/game.py``; names re-exported."""

from megatron_rl.environments.next_digit.game import Episode, NextDigitGame  # noqa: F401
