"""The ``next_digit`` config section: the rules of the next-digit game (``game.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_rl.config import AT_LEAST_1, FINITE, NON_NEGATIVE, ConfigSection


@dataclass(kw_only=True)
class NextDigitConfig(ConfigSection):
    """The next-digit game (``job.environment: next_digit``, the default); old spelling ``demo.<key>``."""

    SECTION: ClassVar[str] = "next_digit"

    num_turns: int = field(default=3, metadata=AT_LEAST_1)
    """Turns per episode."""
    digit_offset: int = field(default=1, metadata=FINITE)
    """The game's rule: the right answer to digit d is (d + digit_offset) mod 10."""
    baseline_episodes: int = field(default=2000, metadata=NON_NEGATIVE)
    """Episodes a uniformly random policy plays to estimate the random-baseline reward of the summary."""
    eval_games: int = field(default=100, metadata=AT_LEAST_1)
    """Held-out games per evaluation (``eval.interval``) when ``eval.num_prompts`` is unset."""
