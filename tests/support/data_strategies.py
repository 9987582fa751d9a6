"""Hypothesis strategies and plain-loop reference implementations shared by the data tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

TOKENS = st.integers(min_value=1, max_value=50)


@st.composite
def rollouts(draw, max_rows: int = 6, max_len: int = 12, per_token_rewards: bool | None = None) -> dict:
    """A random non-step-wise GeneratorOutput (plain lists), lengths often anti-correlated."""
    num_rows = draw(st.integers(1, max_rows))
    out = {k: [] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs", "uids")}
    for i in range(num_rows):
        prompt = draw(st.lists(TOKENS, min_size=1, max_size=max_len))
        response = draw(st.lists(TOKENS, min_size=1, max_size=max(1, max_len - len(prompt) + 1)))
        r = len(response)
        per_token = draw(st.booleans()) if per_token_rewards is None else per_token_rewards
        floats = st.floats(-3, 3, width=32)
        out["prompt_token_ids"].append(prompt)
        out["response_ids"].append(response)
        out["rewards"].append(draw(st.lists(floats, min_size=r, max_size=r)) if per_token else draw(floats))
        out["loss_masks"].append(draw(st.lists(st.integers(0, 1), min_size=r, max_size=r)))
        logprobs = st.floats(-3, 0, width=32)  # log-probabilities are <= 0 (validate_generator_output)
        out["rollout_logprobs"].append(draw(st.lists(logprobs, min_size=r, max_size=r)))
        out["uids"].append(i)
    return out


def reference_convert(pad_token_id, prompts, responses, rewards, loss_masks, logprobs=None):
    """Loop version of convert_prompts_responses_to_batch_tensors (docs/DESIGN.md section 2)."""
    num_rows = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    resp_width = max(len(r) for r in responses)
    sequences = torch.full((num_rows, width), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((num_rows, width), dtype=torch.int64)
    response_mask = torch.zeros((num_rows, resp_width), dtype=torch.int64)
    reward_t = torch.zeros((num_rows, resp_width))
    loss_t = torch.zeros((num_rows, resp_width))
    logprob_t = torch.zeros((num_rows, resp_width))
    for i in range(num_rows):
        tokens = list(prompts[i]) + list(responses[i])
        r = len(responses[i])
        for j, tok in enumerate(tokens):
            sequences[i, width - len(tokens) + j] = tok
            attention[i, width - len(tokens) + j] = 1
        for j in range(r):
            col = resp_width - r + j
            response_mask[i, col] = 1
            loss_t[i, col] = float(loss_masks[i][j])
            if logprobs is not None:
                logprob_t[i, col] = float(logprobs[i][j])
            if isinstance(rewards[i], list):
                reward_t[i, col] = float(rewards[i][j])
        if not isinstance(rewards[i], list):
            reward_t[i, resp_width - 1] = float(rewards[i])
    return sequences, attention, response_mask, reward_t, loss_t, (logprob_t if logprobs is not None else None)
