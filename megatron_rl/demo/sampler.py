"""Moved to ``megatron_rl/inference/builtin_engine.py`` (the built-in rollout engine); names re-exported."""

from megatron_rl.inference.builtin_engine import (  # noqa: F401
    NextTokenLogprobs,
    Samples,
    SamplingParams,
    sample_next_tokens,
    sample_responses,
    sampling_generator,
    uniform_next_token_logprobs,
)
