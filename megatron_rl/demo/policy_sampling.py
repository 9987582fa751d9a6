"""The sampler's view of the Megatron policy: ``next_token_logprobs(contexts) -> [n, V]``.

Place in the data flow: ``demo/rollout.py`` -> ``demo/sampler.py`` -> here -> ``MegatronPolicy.forward``.

The policy's public forward returns log-probs of *given* response tokens (docs/INTERFACES.md). The full next-token
distribution after a context is those log-probs for every candidate token: one forward over ``n x V`` rows
``context + [v]`` (responses of length 1). This runs through the policy's own TP/PP/DP path on every rank and
returns the same values on every rank, so all ranks sample the same tokens; no extra collective is needed. Cost
is V times a plain forward, fine for the demo's 16-token vocabulary (identical contexts, e.g. the first turn of
the samples of one prompt, are computed once). A large-vocabulary generator would instead gather the logits of
the last position (or use an inference engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.data.batch import TrainingBatch, convert_prompts_responses_to_batch_tensors
from megatron_rl.demo.sampler import NextTokenLogprobs


def candidate_batch(contexts: Sequence[Sequence[int]], vocab_size: int, pad_token_id: int) -> TrainingBatch:
    """Rows ``contexts[i] + [v]`` for every i and v (row ``i * vocab_size + v``), response = ``[v]``."""
    prompts = [list(c) for c in contexts for _ in range(vocab_size)]
    responses = [[v] for _ in contexts for v in range(vocab_size)]
    ones = [[1] for _ in responses]
    sequences, attention_mask, response_mask, rewards, loss_mask, _ = convert_prompts_responses_to_batch_tensors(
        pad_token_id, prompts, responses, [0.0] * len(prompts), ones
    )
    tensors = {"sequences": sequences, "attention_mask": attention_mask, "response_mask": response_mask,
               "loss_mask": loss_mask, "rewards": rewards}
    num_rows = len(prompts)
    return TrainingBatch(tensors, list(range(num_rows)), list(range(num_rows)), [True] * num_rows)


def policy_next_token_logprobs(policy, vocab_size: int, pad_token_id: int) -> NextTokenLogprobs:
    """``contexts -> [n, vocab_size]`` next-token log-probs of ``policy`` (anything with ``forward(batch)``)."""

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        unique = list(dict.fromkeys(tuple(c) for c in contexts))
        position = {c: i for i, c in enumerate(unique)}
        logprobs = policy.forward(candidate_batch(unique, vocab_size, pad_token_id))["logprobs"]  # [u*V, 1]
        table = logprobs[:, -1].float().cpu().view(len(unique), vocab_size)  # [u, V]
        return table[torch.tensor([position[tuple(c)] for c in contexts])]  # [n, V]

    return next_token_logprobs
