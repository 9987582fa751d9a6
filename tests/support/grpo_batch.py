"""The rollouts of one GRPO step on an engine's samples, as the engine-agreement tests feed them to the trainer."""

from __future__ import annotations


def even_token_rollouts(group_prompts: list[list[int]], completions: list, group_size: int = 4) -> dict:
    """Reward = the share of even token ids in a response (varies within a group, so advantages are non-zero and
    the policy moves); every response token trained; rollout log-probs are the engine's."""
    return {
        "prompt_token_ids": group_prompts,
        "response_ids": [c.token_ids for c in completions],
        "rewards": [float(sum(t % 2 == 0 for t in c.token_ids)) / len(c.token_ids) for c in completions],
        "loss_masks": [[1] * len(c.token_ids) for c in completions],
        "uids": [i // group_size for i in range(len(group_prompts))],
        "rollout_logprobs": [c.logprobs for c in completions],
    }
