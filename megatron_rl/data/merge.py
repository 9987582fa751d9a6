"""Prefix-aware merging of step-wise turns (docs/DESIGN.md section 6).

Place in the data flow (docs/DESIGN.md section 1): optional, step-wise only, between validation and conversion.
Within one trajectory, step ``i+1`` joins the current group when ``group_prompt + group_response`` is a prefix
of ``prompt[i+1]``; the tokens between (the observation) are appended to the group response with loss_mask 0,
logprob 0 and (per-token) reward 0, followed by ``response[i+1]``:

    group:      prompt_0 | resp_0
    prompt_1 =  prompt_0   resp_0   obs_1           (prefix matches -> merge)
    merged:     prompt_0 | resp_0   obs_1   resp_1      loss_mask [m_0, 0..0, m_1]

The observation may be empty (the response already contains it, e.g. tool output inside the response with
loss_mask 0), or split between the response and the next prompt: both are the same prefix test. A mismatch
(re-tokenization, a truncated history) starts a new group. Groups never cross trajectories.

Scalar rewards: a merged group takes its last step's reward (the trajectory reward sits on the last step).
Per-token rewards are concatenated like loss masks. Mixing both kinds inside one group is a ``ValueError``.
Routed experts (R3): a merged group's tokens are exactly its last step's prompt + response, so it takes that
step's ``routed_experts`` row.
Teacher ids (distillation): one per trajectory, so a merged group keeps it.
Images (a vision-language model): each step's are every image of its prompt (``environments/conversation.py``), so
a merged group takes its last step's, as for routed experts.
Output keys: the standard per-sequence fields (``rollout_logprobs`` / ``stop_reasons`` / ``routed_experts`` /
``teacher_ids`` / ``images`` only when given);
other keys are dropped. Cost: O(tokens of the input) per trajectory (list slice comparisons, amortized appends).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.generator_output import GeneratorOutput, is_scalar_reward, validate_generator_output


@dataclass
class _Group:
    """One merged sequence under construction."""

    prompt: list[int]
    response: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None
    reward: Any  # float, or list[float] for per-token rewards
    uid: Hashable
    trajectory_id: Hashable
    stop_reason: Any
    routed_experts: Any = None
    teacher_id: Any = None
    images: Any = None


def merge_stepwise_output(
    out: GeneratorOutput, *, validated: bool = False
) -> tuple[GeneratorOutput, dict[str, int]]:
    """Merge consecutive steps of each trajectory whose prompts extend the previous prompt + response.

    Returns ``(merged, {"num_seq_before_merge": N, "num_seq_after_merge": M})``; ``merged`` is a valid step-wise
    ``GeneratorOutput`` (``is_last_step`` true on each trajectory's last merged group), so it needs no second
    validation. ``validated=True``: the caller already ran ``validate_generator_output(out, step_wise=True)``
    (the Trainer does, once, at its entry); library callers leave it False and get the same ValueErrors.
    """
    if not validated:
        out = validate_generator_output(out, step_wise=True)
    groups: list[_Group] = []
    for i in range(len(out["prompt_token_ids"])):
        starts_trajectory = i == 0 or out["trajectory_ids"][i] != out["trajectory_ids"][i - 1]
        if not starts_trajectory and _extends(groups[-1], out["prompt_token_ids"][i]):
            _append_step(groups[-1], out, i)
        else:
            groups.append(_new_group(out, i))
    merged = _to_generator_output(groups, out)
    return merged, {"num_seq_before_merge": len(out["prompt_token_ids"]), "num_seq_after_merge": len(groups)}


def _extends(group: _Group, prompt: list[int]) -> bool:
    """``group.prompt + group.response`` is a prefix of ``prompt`` (two slice comparisons, no concatenation)."""
    num_prompt, num_response = len(group.prompt), len(group.response)
    if len(prompt) < num_prompt + num_response:
        return False
    return (
        list(prompt[:num_prompt]) == group.prompt
        and list(prompt[num_prompt : num_prompt + num_response]) == group.response
    )


def _new_group(out: GeneratorOutput, i: int) -> _Group:
    logprobs = out.get("rollout_logprobs")
    reward = out["rewards"][i]
    stop_reasons = out.get("stop_reasons")
    return _Group(
        prompt=list(out["prompt_token_ids"][i]),
        response=list(out["response_ids"][i]),
        loss_mask=list(out["loss_masks"][i]),
        logprobs=list(logprobs[i]) if logprobs is not None else None,
        reward=reward if is_scalar_reward(reward) else list(reward),
        uid=out["uids"][i],
        trajectory_id=out["trajectory_ids"][i],
        stop_reason=stop_reasons[i] if stop_reasons is not None else None,
        routed_experts=_row(out, "routed_experts", i),
        teacher_id=_row(out, "teacher_ids", i),  # one per trajectory (validated): the group's
        images=_row(out, "images", i),
    )


def _append_step(group: _Group, out: GeneratorOutput, i: int) -> None:
    """Append step ``i``'s observation (``prompt[i]`` past the group's tokens) and response to ``group``."""
    observation = out["prompt_token_ids"][i][len(group.prompt) + len(group.response) :]
    num_obs = len(observation)
    group.response += observation
    group.response += out["response_ids"][i]
    group.loss_mask += [0] * num_obs
    group.loss_mask += out["loss_masks"][i]
    if group.logprobs is not None:
        group.logprobs += [0.0] * num_obs
        group.logprobs += out["rollout_logprobs"][i]
    group.reward = _merged_reward(group, out["rewards"][i], num_obs, i)
    stop_reasons = out.get("stop_reasons")
    group.stop_reason = stop_reasons[i] if stop_reasons is not None else None
    group.routed_experts = _row(out, "routed_experts", i)  # the last step's tokens are the whole group's
    group.images = _row(out, "images", i)  # ... and its images every image of them


def _row(out: GeneratorOutput, name: str, i: int) -> Any:
    values = out.get(name)
    return values[i] if values is not None else None


def _merged_reward(group: _Group, reward: Any, num_obs: int, i: int) -> Any:
    if is_scalar_reward(group.reward) != is_scalar_reward(reward):
        raise ValueError(
            f"GeneratorOutput['rewards'][{i}] is {'a scalar' if is_scalar_reward(reward) else 'per-token'} but "
            f"earlier steps of trajectory {group.trajectory_id!r} merged with it are not: use one reward kind "
            "per trajectory."
        )
    if is_scalar_reward(reward):
        return reward
    group.reward += [0.0] * num_obs
    group.reward += reward
    return group.reward


def _to_generator_output(groups: list[_Group], original: GeneratorOutput) -> GeneratorOutput:
    merged: GeneratorOutput = {
        "prompt_token_ids": [g.prompt for g in groups],
        "response_ids": [g.response for g in groups],
        "rewards": [g.reward for g in groups],
        "loss_masks": [g.loss_mask for g in groups],
        "uids": [g.uid for g in groups],
        "trajectory_ids": [g.trajectory_id for g in groups],
        "is_last_step": [
            i == len(groups) - 1 or groups[i + 1].trajectory_id != g.trajectory_id for i, g in enumerate(groups)
        ],
    }
    if original.get("rollout_logprobs") is not None:
        merged["rollout_logprobs"] = [g.logprobs for g in groups]
    if original.get("stop_reasons") is not None:
        merged["stop_reasons"] = [g.stop_reason for g in groups]
    if original.get("routed_experts") is not None:
        merged["routed_experts"] = [g.routed_experts for g in groups]
    if original.get("teacher_ids") is not None:
        merged["teacher_ids"] = [g.teacher_id for g in groups]
    if original.get("images") is not None:
        merged["images"] = [g.images for g in groups]
    return merged
