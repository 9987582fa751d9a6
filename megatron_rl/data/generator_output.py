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
  each trajectory's final step (hence also on the final entry);
- values: every reward is finite (wherever it sits, also on a step whose reward is not used), every rollout
  log-prob is finite and ``<= LOGPROB_TOLERANCE`` (a log-probability is <= 0; float rounding aside), uids are
  hashable;
- ``teacher_ids[i]`` (optional; on-policy distillation, megatron_rl/distillation) is an int, the index of the
  ``distillation.teachers`` entry that scores the row, or -1 (no teacher); step-wise, every step of a trajectory
  has the same one (its prompt row's);
- ``routed_experts[i]`` (optional; MoE routing replay R3, model/router_replay.py) is an integer array
  ``[p_i + r_i, L, k]``: the engine's top-k experts of every MoE layer for each prompt and response token, one
  ``(L, k)`` for all rows, ids in ``[0, num_experts)`` when the caller passes ``routing=(L, k, num_experts)``;
- keys: ``out`` is a mapping holding only ``REQUIRED_FIELDS`` and ``OPTIONAL_FIELDS`` (an unknown key, e.g.
  ``advantages``, would be silently unused, so it is rejected).

Tensors and NumPy arrays holding valid data are accepted wherever a list or a number is: a field, a row, a
0-d reward. ``validate_generator_output`` returns the rollouts as plain Python lists and numbers (tensors
detached, copied to the host; ``routed_experts`` rows as NumPy integer arrays, not nested lists); ``out`` itself is never modified, and is returned as is when it is plain.

This module is the one owner of these rules: the Trainer validates once at its entry; ``merge_stepwise_output``
and ``TrainingBatch.from_generator_output`` call it for library users. Every violation raises ``ValueError``
naming the field and the sequence index, before any state changes.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Hashable, Mapping
from typing import Any, NotRequired, TypedDict

import numpy as np


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
    routed_experts: NotRequired[list[Any] | None]
    """MoE routing replay R3: per sequence an integer array ``[p_i + r_i, L, k]``, the engine's top-k experts of
    each MoE layer for every prompt and response token."""
    teacher_ids: NotRequired[list[int] | None]
    """On-policy distillation: per sequence the index of the ``distillation.teachers`` entry that scores it (its
    prompt row's, by the teachers' ``when``), -1 = no teacher. None = every row teacher 0 (one teacher, no
    ``when``)."""
    images: NotRequired[list[Any] | None]
    """Prompts with images (a vision-language policy, docs/VISION.md): per sequence a list of
    ``(pixel_values [n, F] float tensor, (t, h, w))``, one per image of its prompt in order (``[]``: none); the
    trainer's batch gets them as ``pixel_values`` / ``image_grid_thw`` (``data/mrope.py: batch_images``)."""


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
    "routed_experts",
    "teacher_ids",
    "images",
)
"""Fields holding one entry per sequence (all must have the same length when present)."""

REQUIRED_FIELDS = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "uids")
OPTIONAL_FIELDS = ("rollout_logprobs", "trajectory_ids", "is_last_step", "stop_reasons", "routed_experts",
                   "teacher_ids", "images")
"""The only other keys a ``GeneratorOutput`` may hold (``None`` = absent). Anything else is rejected."""
STEP_WISE_FIELDS = ("trajectory_ids", "is_last_step")
TOKEN_FIELDS = ("prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs")
"""Fields whose rows are lists of per-token values."""
LOGPROB_TOLERANCE = 1e-6
"""A rollout log-prob above this is not a log-probability (float rounding of log(1) stays far below it)."""


def is_scalar_reward(reward: Any) -> bool:
    """True for a per-sequence reward (a number), False for a per-token list."""
    return isinstance(reward, numbers.Real)


def validate_generator_output(out: GeneratorOutput, step_wise: bool, *,
                              routing: tuple[int, int, int] | None = None) -> GeneratorOutput:
    """Check the invariants listed in the module docstring; raise ``ValueError`` on the first violation.

    ``routing``: ``(L, k, num_experts)`` of the MoE model that will replay ``routed_experts`` (None: their
    shape and range are checked only for consistency). Returns ``out`` as plain lists and numbers (the same
    object when it already is). Cost: O(number of sequences) in Python, plus one vectorized pass over rewards,
    rollout log-probs and each row of routed experts.
    """
    if not isinstance(out, Mapping):
        raise ValueError(f"GeneratorOutput must be a mapping (a dict of per-sequence lists), got a "
                         f"{type(out).__name__}; build it as dict(prompt_token_ids=..., response_ids=..., ...).")
    _check_known_keys(out)
    out = _as_plain(out)
    _check_fields_present(out, step_wise)
    num_seqs = _check_list_lengths(out)
    for i in range(num_seqs):
        _check_sequence(out, i)
    _check_values(out)
    if out.get("routed_experts") is not None:
        out = {**out, "routed_experts": _check_routed_experts(out, routing)}  # a copy: ``out`` is not modified
    if out.get("teacher_ids") is not None:
        _check_teacher_ids(out["teacher_ids"], out["trajectory_ids"] if step_wise else None)
    if step_wise:
        _check_step_wise(out["trajectory_ids"], out["is_last_step"], out["uids"])
        _check_rewards_on_last_steps(out["rewards"], out["is_last_step"])
    return out


def _check_teacher_ids(teacher_ids: list, trajectory_ids: list | None) -> None:
    """Each an int >= -1; step-wise, one per trajectory (every step has its prompt row's teacher)."""
    for i, tid in enumerate(teacher_ids):
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral) or tid < -1:
            raise ValueError(f"GeneratorOutput['teacher_ids'][{i}] = {tid!r}: give the index of the "
                             "distillation.teachers entry that scores the row, or -1 for none")
        if trajectory_ids is not None and i > 0 and trajectory_ids[i] == trajectory_ids[i - 1] \
                and tid != teacher_ids[i - 1]:
            raise ValueError(f"GeneratorOutput['teacher_ids'][{i}] = {tid!r} differs from teacher_ids[{i - 1}] = "
                             f"{teacher_ids[i - 1]!r} within trajectory {trajectory_ids[i]!r}: every step of a "
                             "trajectory is scored by its prompt row's teacher")


def _check_known_keys(out: Mapping) -> None:
    unknown = sorted(str(k) for k in out if k not in REQUIRED_FIELDS + OPTIONAL_FIELDS)
    if unknown:
        raise ValueError(
            f"GeneratorOutput has unknown key(s) {unknown}: they would be silently unused (the trainer computes "
            f"advantages, returns, old/ref log-probs itself). Known keys: required {list(REQUIRED_FIELDS)}, "
            f"optional {list(OPTIONAL_FIELDS)}; remove the others."
        )


def _plain(value: Any) -> Any:
    """A tensor (detached, on the host) or NumPy array/scalar as Python lists/numbers; anything else as is."""
    if hasattr(value, "detach"):  # torch.Tensor (this module does not import torch)
        value = value.detach().cpu()
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "detach") else value


def _as_plain(out: Mapping) -> dict:
    """``out`` with every tensor/array field, row or uid converted by ``_plain`` (copies only what changes)."""
    plain = dict(out)
    changed = False
    for name in PER_SEQUENCE_FIELDS:
        if name in ("routed_experts", "images"):
            continue  # rows stay arrays (_check_routed_experts) / tensors
        values = plain.get(name)
        converted = _plain(values)
        if isinstance(converted, (list, tuple)):
            rows = [_plain(v) for v in converted]
            if converted is not values or any(r is not v for r, v in zip(rows, converted)):
                plain[name], changed = rows, True
    return plain if changed else out


def _check_fields_present(out: GeneratorOutput, step_wise: bool) -> None:
    required = REQUIRED_FIELDS + (STEP_WISE_FIELDS if step_wise else ())
    for name in required:
        if out.get(name) is None:
            hint = " (step-wise training needs trajectory_ids and is_last_step)" if name in STEP_WISE_FIELDS else ""
            raise ValueError(f"GeneratorOutput is missing field {name!r}{hint}: add one entry per sequence.")


def _check_list_lengths(out: GeneratorOutput) -> int:
    for name in PER_SEQUENCE_FIELDS:
        values = out.get(name)
        if values is not None and not isinstance(values, (list, tuple)):
            raise ValueError(f"GeneratorOutput[{name!r}] is a {type(values).__name__}, expected a list with one "
                             "entry per sequence.")
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
    for name in ("prompt_token_ids", "response_ids"):
        _check_row_is_list(out, name, i)
    _check_hashable(out["uids"][i], i, "uids")
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


def _check_row_is_list(out: GeneratorOutput, name: str, i: int, what: str = "token ids") -> None:
    value = out[name][i]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"GeneratorOutput[{name!r}][{i}] is a {type(value).__name__}, expected a list of {what}.")


def _check_token_aligned(out: GeneratorOutput, name: str, i: int, num_response: int) -> None:
    value = out[name][i]
    if not isinstance(value, (list, tuple)):  # tensors and arrays were converted to lists by _as_plain
        raise ValueError(
            f"GeneratorOutput[{name!r}][{i}] is a {type(value).__name__}, expected a list with one value per "
            f"response token ({num_response})."
        )
    if len(value) != num_response:
        raise ValueError(
            f"GeneratorOutput[{name!r}][{i}] has length {len(value)} but response_ids[{i}] has length "
            f"{num_response}: give one value per response token."
        )


def _check_values(out: GeneratorOutput) -> None:
    """Finite rewards (every row, last step or not); finite rollout log-probs ``<= LOGPROB_TOLERANCE``."""
    _check_numbers(out["rewards"], "rewards", "fix the reward function (every reward must be finite)")
    if out.get("rollout_logprobs") is not None:
        values = _check_numbers(out["rollout_logprobs"], "rollout_logprobs", "fix the sampler's log-probs")
        above = np.flatnonzero(values > LOGPROB_TOLERANCE)
        if len(above):
            i, j = _row_and_column(out["rollout_logprobs"], int(above[0]))
            raise ValueError(
                f"GeneratorOutput['rollout_logprobs'][{i}][{j}] = {values[above[0]]!r} is above 0: a log-probability "
                f"is <= 0 (tolerance {LOGPROB_TOLERANCE}); pass log-probs (log_softmax), not logits or probabilities."
            )


def _check_routed_experts(out: GeneratorOutput, routing: tuple[int, int, int] | None) -> list[np.ndarray]:
    """Each row an integer ``[p_i + r_i, L, k]`` array (one ``(L, k)`` for all rows, ``routing``'s when given),
    expert ids in ``[0, num_experts)``; returns the rows as NumPy arrays (a tensor row copied to the host)."""
    rows = [_routing_array(row, i) for i, row in enumerate(out["routed_experts"])]
    want = routing[:2] if routing is not None else rows[0].shape[1:]
    for i, row in enumerate(rows):
        tokens = len(out["prompt_token_ids"][i]) + len(out["response_ids"][i])
        if row.shape != (tokens, *want):
            raise ValueError(f"GeneratorOutput['routed_experts'][{i}] has shape {row.shape}, expected "
                             f"[len(prompt) + len(response), L, k] = {(tokens, *want)}: one top-k per token and MoE "
                             "layer of the model (model.num_layers, model.moe_router_topk).")
        high = routing[2] if routing is not None else None
        if row.size and (int(row.min()) < 0 or (high is not None and int(row.max()) >= high)):
            raise ValueError(f"GeneratorOutput['routed_experts'][{i}] holds expert ids in [{int(row.min())}, "
                             f"{int(row.max())}], outside [0, num_moe_experts={high}).")
    return rows


def _routing_array(row: Any, i: int) -> np.ndarray:
    if hasattr(row, "detach"):
        row = row.detach().cpu().numpy()
    array = np.asarray(row)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"GeneratorOutput['routed_experts'][{i}] is a {array.ndim}-d {array.dtype} array, expected "
                         "integer expert ids [tokens, L, k].")
    return array


def _check_numbers(rows: list, name: str, fix: str) -> np.ndarray:
    """All values of ``rows`` (numbers or lists of numbers) as one float64 vector; ValueError naming the row
    of the first non-number or non-finite value."""
    try:
        values = np.concatenate([_numeric(row) for row in rows] or [np.empty(0)])
    except (TypeError, ValueError):
        for i, row in enumerate(rows):
            for v in row if isinstance(row, (list, tuple)) else (row,):
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise ValueError(f"GeneratorOutput[{name!r}][{i}] holds a {type(v).__name__} ({v!r}), expected "
                                     f"numbers; {fix}.") from None
        raise
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        i, _ = _row_and_column(rows, int(bad[0]))
        raise ValueError(f"GeneratorOutput field {name!r}: {name}[{i}] holds a NaN or infinite value "
                         f"({values[bad[0]]!r}); {fix}.")
    return values


def _numeric(row: Any) -> np.ndarray:
    """``row`` as a float64 vector; TypeError for anything but numbers (``None`` would become NaN silently)."""
    array = np.asarray(row)
    if array.dtype.kind not in "biuf":
        raise TypeError(array.dtype)
    return array.astype(np.float64).reshape(-1)


def _row_and_column(rows: list, flat_index: int) -> tuple[int, int]:
    """(row, column) of the ``flat_index``-th value of ``rows`` flattened (a scalar row counts as one value)."""
    for i, row in enumerate(rows):
        n = len(row) if isinstance(row, (list, tuple)) else 1
        if flat_index < n:
            return i, flat_index
        flat_index -= n
    raise AssertionError("flat index beyond the rows")


def _check_step_wise(trajectory_ids: list[Hashable], is_last_step: list[bool], uids: list[Hashable]) -> None:
    """Steps of a trajectory contiguous and sharing a uid; ``is_last_step`` exactly at trajectory ends."""
    finished: set[Hashable] = set()
    num_seqs = len(trajectory_ids)
    for i, tid in enumerate(trajectory_ids):
        _check_hashable(tid, i, "trajectory_ids")
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


def _check_hashable(value: Any, i: int, name: str) -> None:
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"GeneratorOutput[{name!r}][{i}] = {value!r} is not hashable: use a string, int or tuple."
        ) from None
