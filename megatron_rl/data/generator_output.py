"""Rollouts as handed to the trainer: ``GeneratorOutput`` and its validation.

Place in the data flow (docs/DESIGN.md section 1): the very first stage. A generator (sampler, environment loop,
Tinker-style client) produces one ``GeneratorOutput`` per training batch; ``validate_generator_output`` checks it
before anything is converted to tensors, so every later stage can rely on these invariants:

- every per-sequence list has the same length ``N`` (one entry per sequence, i.e. per turn in step-wise mode);
- ``prompt_token_ids[i]`` is non-empty: the first response token's log-prob needs a preceding token;
- ``response_ids[i]`` is non-empty. Empty responses are **rejected**, not handled: a row without response
  tokens has nowhere to hold its reward or any loss, so it could only be silently dropped. A generator that
  stops immediately should return its EOS token as the response;
- ``len(loss_masks[i]) == len(response_ids[i])``, likewise ``rollout_logprobs[i]`` and per-token ``rewards[i]``;
- ``rewards[i]`` is a number (one reward per sequence, placed on its last response token) or a list of
  per-token rewards; both kinds may appear in one batch;
- step-wise: the steps of one trajectory are contiguous, share one uid, and ``is_last_step`` is true exactly on
  each trajectory's final step (hence also on the final entry).

Every violation raises ``ValueError`` naming the field and the sequence index.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Hashable
from typing import Any, NotRequired, TypedDict


class GeneratorOutput(TypedDict):
    """Rollouts of one training batch, one entry per sequence (plain lists, no tensors)."""

    prompt_token_ids: list[list[int]]
    """Prompt tokens per sequence (non-empty)."""
    response_ids: list[list[int]]
    """Generated tokens per sequence (non-empty); in multi-turn data may include tool/observation tokens."""
    rewards: list[float] | list[list[float]]
    """Per sequence: a scalar (credited to the last response token) or a per-token list."""
    loss_masks: list[list[int]]
    """Per response token: 1 = trained on, 0 = ignored (observation tokens)."""
    uids: list[Hashable]
    """Prompt (group) id per sequence; sequences of one prompt are contiguous."""
    rollout_logprobs: NotRequired[list[list[float]] | None]
    """Sampler log-probs per response token (for off-policy correction)."""
    trajectory_ids: NotRequired[list[Hashable] | None]
    """Trajectory id per sequence (any hashable, e.g. ``(prompt_id, sample_index)``). Required step-wise."""
    is_last_step: NotRequired[list[bool] | None]
    """True on the last step of each trajectory. Required step-wise."""
    stop_reasons: NotRequired[list[str] | None]
    """Why generation stopped ("stop", "length", ...), per sequence."""


PER_SEQUENCE_FIELDS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "uids",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
    "stop_reasons",
)
"""Fields holding one entry per sequence (all must have the same length when present)."""

REQUIRED_FIELDS = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "uids")
STEP_WISE_FIELDS = ("trajectory_ids", "is_last_step")


def is_scalar_reward(reward: Any) -> bool:
    """True for a per-sequence reward (a number), False for a per-token list."""
    return isinstance(reward, numbers.Real)


def validate_generator_output(out: GeneratorOutput, step_wise: bool) -> None:
    """Check the invariants listed in the module docstring; raise ``ValueError`` on the first violation.

    Cost: O(number of sequences); token lists are only measured, never scanned.
    """
    _check_fields_present(out, step_wise)
    num_seqs = _check_list_lengths(out)
    for i in range(num_seqs):
        _check_sequence(out, i)
    if step_wise:
        _check_step_wise(out["trajectory_ids"], out["is_last_step"], out["uids"])
        _check_rewards_on_last_steps(out["rewards"], out["is_last_step"])


def _check_fields_present(out: GeneratorOutput, step_wise: bool) -> None:
    required = REQUIRED_FIELDS + (STEP_WISE_FIELDS if step_wise else ())
    for name in required:
        if out.get(name) is None:
            hint = " (step-wise training needs trajectory_ids and is_last_step)" if name in STEP_WISE_FIELDS else ""
            raise ValueError(f"GeneratorOutput is missing field {name!r}{hint}: add one entry per sequence.")


def _check_list_lengths(out: GeneratorOutput) -> int:
    num_seqs = len(out["prompt_token_ids"])
    for name in PER_SEQUENCE_FIELDS:
        values = out.get(name)
        if values is not None and len(values) != num_seqs:
            raise ValueError(
                f"GeneratorOutput[{name!r}] has {len(values)} entries but prompt_token_ids has {num_seqs}: "
                "every per-sequence field needs exactly one entry per sequence."
            )
    return num_seqs


def _check_sequence(out: GeneratorOutput, i: int) -> None:
    if len(out["prompt_token_ids"][i]) == 0:
        raise ValueError(
            f"GeneratorOutput['prompt_token_ids'][{i}] is empty: the first response token's log-prob needs a "
            "preceding token; add at least a BOS token to the prompt."
        )
    num_response = len(out["response_ids"][i])
    if num_response == 0:
        raise ValueError(
            f"GeneratorOutput['response_ids'][{i}] is empty: a sequence needs at least one response token to "
            "carry its reward and loss; return the EOS token as the response, or drop the sequence."
        )
    _check_token_aligned(out, "loss_masks", i, num_response)
    if out.get("rollout_logprobs") is not None:
        _check_token_aligned(out, "rollout_logprobs", i, num_response)
    if not is_scalar_reward(out["rewards"][i]):
        _check_token_aligned(out, "rewards", i, num_response)


def _check_token_aligned(out: GeneratorOutput, name: str, i: int, num_response: int) -> None:
    value = out[name][i]
    if not hasattr(value, "__len__") or isinstance(value, str):  # lists; arrays are tolerated
        raise ValueError(
            f"GeneratorOutput[{name!r}][{i}] is a {type(value).__name__}, expected a list with one value per "
            f"response token ({num_response})."
        )
    if len(value) != num_response:
        raise ValueError(
            f"GeneratorOutput[{name!r}][{i}] has length {len(value)} but response_ids[{i}] has length "
            f"{num_response}: give one value per response token."
        )


def _check_step_wise(trajectory_ids: list[Hashable], is_last_step: list[bool], uids: list[Hashable]) -> None:
    """Steps of a trajectory contiguous and sharing a uid; ``is_last_step`` exactly at trajectory ends."""
    finished: set[Hashable] = set()
    num_seqs = len(trajectory_ids)
    for i, tid in enumerate(trajectory_ids):
        _check_hashable(tid, i)
        ends_here = i == num_seqs - 1 or trajectory_ids[i + 1] != tid
        if tid in finished:
            raise ValueError(
                f"GeneratorOutput['trajectory_ids'][{i}] = {tid!r} reappears after other trajectories: the steps "
                "of one trajectory must be contiguous; group them together."
            )
        if bool(is_last_step[i]) != ends_here:
            where = "the final entry" if i == num_seqs - 1 else f"trajectory {tid!r}"
            raise ValueError(
                f"GeneratorOutput['is_last_step'][{i}] is {is_last_step[i]!r} but should be {ends_here} "
                f"({where} {'ends' if ends_here else 'continues'} here): is_last_step must be true exactly on "
                "each trajectory's last step."
            )
        if not ends_here and uids[i + 1] != uids[i]:
            raise ValueError(
                f"GeneratorOutput['uids'][{i + 1}] = {uids[i + 1]!r} differs from uids[{i}] = {uids[i]!r} within "
                f"trajectory {tid!r}: all steps of a trajectory belong to one prompt."
            )
        if ends_here:
            finished.add(tid)


def _check_rewards_on_last_steps(rewards: list, is_last_step: list[bool]) -> None:
    """Outcome estimators read each trajectory's last step only (docs/DESIGN.md section 6): warn (once per call)
    when a reward sits anywhere else, since it does not reach the advantages."""
    for i, (reward, last) in enumerate(zip(rewards, is_last_step)):
        if last:
            continue
        if (reward != 0) if is_scalar_reward(reward) else any(r != 0 for r in reward):
            warnings.warn(
                f"GeneratorOutput['rewards'][{i}] is non-zero on a step that is not its trajectory's last "
                f"(is_last_step[{i}] is False): step-wise advantages use the last step's reward only, so it is "
                "ignored; put the trajectory's reward on its last step.",
                stacklevel=3,
            )
            return


def _check_hashable(tid: Any, i: int) -> None:
    try:
        hash(tid)
    except TypeError:
        raise ValueError(
            f"GeneratorOutput['trajectory_ids'][{i}] = {tid!r} is not hashable: use a string, int or tuple."
        ) from None
