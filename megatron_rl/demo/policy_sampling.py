"""Moved to ``megatron_rl/inference/builtin_engine.py`` (the built-in rollout engine); names re-exported."""

from megatron_rl.data.batch import left_pad as left_padded  # noqa: F401
from megatron_rl.inference.builtin_engine import policy_next_token_logprobs  # noqa: F401
