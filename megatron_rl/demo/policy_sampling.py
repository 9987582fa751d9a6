"""The sampler's view of the Megatron policy: ``next_token_logprobs(contexts) -> [n, V]``.

Place in the data flow: ``demo/rollout.py`` -> ``demo/sampler.py`` -> here -> ``MegatronPolicy.next_token_logprobs``.

Identical contexts (the GRPO group's episodes share their first prompt) are computed once: the distinct
contexts are left-padded into one ``[u, S]`` block and the policy returns the full-vocab log-softmax after each
one's last token, through its pipeline schedule (any TP/PP/DP layout), identical on every rank.

All ranks must sample the same tokens: they run this on the same contexts, get the same table and draw with
identically seeded generators (``demo/sampler.py``); ``megatron_rl/demo/main.py`` checks the rollouts agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.data.batch import left_pad as left_padded  # noqa: F401 (the demo tests import it from here)
from megatron_rl.demo.sampler import NextTokenLogprobs


def policy_next_token_logprobs(policy, pad_token_id: int) -> NextTokenLogprobs:
    """``contexts -> [n, V]`` (V = the policy's ``model.vocab_size``) through ``policy.next_token_logprobs``."""

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        unique, index = _dedupe(contexts)
        logprobs = policy.next_token_logprobs(*left_padded(unique, pad_token_id))  # [u, V]
        return logprobs.float().cpu()[index]  # [n, V]

    return next_token_logprobs


def _dedupe(contexts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Distinct contexts (first-seen order) and, per input context, its index among them."""
    unique = list(dict.fromkeys(tuple(c) for c in contexts))
    position = {c: i for i, c in enumerate(unique)}
    return unique, torch.tensor([position[tuple(c)] for c in contexts])
