"""The sampler's view of the Megatron policy: ``next_token_logprobs(contexts) -> [n, V]``.

Place in the data flow: ``demo/rollout.py`` -> ``demo/sampler.py`` -> here -> the policy's model.

Two ways to get the next-token distribution after each context, same numbers (tested against each other):

- ``last_token_next_token_logprobs`` (used without pipeline parallelism): one forward of the policy's model
  chunk over the packed contexts (THD, as the policy packs), the vocab-parallel log-softmax
  (``model.logprobs``) of the last position for each of the V token ids. Every rank computes every row (DP
  replicas hold equal weights; TP ranks join the vocab all-reduces), so every rank gets the same table.
- ``candidate_next_token_logprobs`` (any layout, PP included): only the policy's public ``forward``, which
  returns log-probs of *given* response tokens: one forward over ``n x V`` rows ``context + [v]``. Exact and
  layout-agnostic but V times the work (about 10x slower per call for the demo's 16 tokens, measured).

All ranks must sample the same tokens: they run this on the same contexts, get the same table and draw with
identically seeded generators (``demo/sampler.py``); ``megatron_rl/main.py`` checks the rollouts agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.data.batch import TrainingBatch, convert_prompts_responses_to_batch_tensors, right_aligned_mask
from megatron_rl.data.packing import pack, packing_alignment
from megatron_rl.demo.sampler import NextTokenLogprobs
from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy


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
    """The fast path without pipeline parallelism, the candidate path with it (module docstring)."""
    if policy.groups.pp_size == 1:
        return last_token_next_token_logprobs(policy, vocab_size)
    return candidate_next_token_logprobs(policy, vocab_size, pad_token_id)


def candidate_next_token_logprobs(policy, vocab_size: int, pad_token_id: int) -> NextTokenLogprobs:
    """``contexts -> [n, vocab_size]`` through ``policy.forward(batch)`` on ``n x V`` candidate rows."""

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        unique, index = _dedupe(contexts)
        logprobs = policy.forward(candidate_batch(unique, vocab_size, pad_token_id))["logprobs"]  # [u*V, 1]
        return logprobs[:, -1].float().cpu().view(len(unique), vocab_size)[index]  # [n, V]

    return next_token_logprobs


def last_token_next_token_logprobs(policy, vocab_size: int) -> NextTokenLogprobs:
    """``contexts -> [n, vocab_size]`` from one forward of ``policy.module`` (needs pipeline size 1)."""
    groups = policy.groups
    assert groups.pp_size == 1, "the last-token path needs the whole model on every rank"
    align = packing_alignment(groups.tp_size, groups.cp_size, groups.sequence_parallel)

    @torch.no_grad()
    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        unique, index = _dedupe(contexts)
        packed = pack(*left_padded(unique), align).to(groups.device)
        module = policy.module.eval()
        logits = module(packed.input_ids, packed.position_ids, None,
                        packed_seq_params=packed.packed_seq_params())  # [1, T, V/tp]
        last = (packed.cu_seqlens[:-1] + packed.seq_lens - 1).long()  # [u] last valid token of each context
        last_logits = logits[0, last]  # [u, V/tp]
        columns = [
            vocab_parallel_logprobs_entropy(last_logits, torch.full_like(last, v), groups.tp_group, False,
                                            valid_vocab_size=vocab_size)[0]
            for v in range(vocab_size)
        ]
        return torch.stack(columns, dim=-1).float().cpu()[index]  # [n, V]

    return next_token_logprobs


def left_padded(contexts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [n, S], attention_mask [n, S])`` with each context right-aligned (DESIGN.md section 2)."""
    lengths = torch.tensor([len(c) for c in contexts])
    mask = right_aligned_mask(lengths, int(lengths.max()))
    tokens = torch.tensor([t for c in contexts for t in c], dtype=torch.long)
    input_ids = torch.full(mask.shape, pad_token_id, dtype=torch.long).masked_scatter_(mask.bool(), tokens)
    return input_ids, mask


def _dedupe(contexts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Distinct contexts (first-seen order) and, per input context, its index among them."""
    unique = list(dict.fromkeys(tuple(c) for c in contexts))
    position = {c: i for i, c in enumerate(unique)}
    return unique, torch.tensor([position[tuple(c)] for c in contexts])
