"""Rollout lists -> the unified left-padded tensor block, and ``TrainingBatch``, the container every later stage uses.

Place in the data flow (docs/DESIGN.md section 1): after validation/merging, before advantages. The layout is the one
of docs/DESIGN.md section 2 (one left-padded block, width ``S = max_i(p_i + r_i)``, response tensors right-aligned
over ``R = max_i(r_i)`` columns):

    sequences[i]       [PAD .. PAD | prompt_i | response_i]      [B, S]
    response_mask[i]   [0 .. 0 | 1 .. 1]  (last r_i columns)     [B, R]

Conversion is vectorized: in row-major order a left-padded block is just the stream
``pad_0, prompt_0, response_0, pad_1, prompt_1, ...``, so each block is written by ONE ``np.concatenate`` of
those pieces straight into the output buffer (the pads are views of one fill vector). Python only walks the
rows to convert each list to an array (C speed per token); no Python loop touches individual tokens, and no
index/mask scatter is needed. The tensors wrap the numpy buffers without a copy (``torch.from_numpy``).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megatron_rl.data.generator_output import GeneratorOutput, is_scalar_reward, validate_generator_output

SEQUENCE_KEY = "sequences"
ARGUMENT_NAMES = {name: name for name in ("prompts", "responses", "rewards", "loss_masks", "logprobs")}
"""How ``convert_prompts_responses_to_batch_tensors``'s errors name its inputs when called directly."""
GENERATOR_OUTPUT_NAMES = {
    "prompts": "GeneratorOutput['prompt_token_ids']", "responses": "GeneratorOutput['response_ids']",
    "rewards": "GeneratorOutput['rewards']", "loss_masks": "GeneratorOutput['loss_masks']",
    "logprobs": "GeneratorOutput['rollout_logprobs']",
}
"""... and when converting a ``GeneratorOutput`` (``TrainingBatch.from_generator_output``): its public keys."""
ATTENTION_MASK_KEY = "attention_mask"


def convert_prompts_responses_to_batch_tensors(
    pad_token_id: int,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rewards: Sequence[float | Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]] | None = None,
    max_seq_len: int | None = None,
    *,
    names: Mapping[str, str] = ARGUMENT_NAMES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Build the left-padded block of docs/DESIGN.md section 2 from per-sequence lists.

    Returns ``(sequences [B,S] int64, attention_mask [B,S] int64, response_mask [B,R] int64,
    rewards [B,R] float32, loss_masks [B,R] float32, logprobs [B,R] float32 | None)``. A scalar reward lands
    on the row's last response token (column ``R-1``). Past ``max_seq_len`` this warns and keeps every token.
    Empty prompts or responses raise ``ValueError`` (see generator_output.py for why). Errors name the inputs
    by ``names`` (argument -> the caller's name for it: ``GENERATOR_OUTPUT_NAMES`` for a ``GeneratorOutput``).
    """
    _check_row_counts(names, prompts=prompts, responses=responses, rewards=rewards, loss_masks=loss_masks,
                      logprobs=logprobs)
    prompt_lens = _row_lengths(prompts, names["prompts"])
    response_lens = _row_lengths(responses, names["responses"])
    total_lens = prompt_lens + response_lens
    _warn_if_too_long(total_lens, max_seq_len)
    seq_width, resp_width = int(total_lens.max()), int(response_lens.max())

    sequences = _right_aligned_block(zip(prompts, responses), total_lens, seq_width, pad_token_id, np.int64)
    attention_mask = right_aligned_mask(torch.from_numpy(total_lens), seq_width)  # [B, S]
    response_mask = right_aligned_mask(torch.from_numpy(response_lens), resp_width)  # [B, R]
    loss_mask_t = _token_aligned_block(loss_masks, response_lens, resp_width, "loss_masks", names)
    rewards_t = _rewards_block(rewards, response_lens, resp_width, names)
    logprobs_t = None if logprobs is None else _token_aligned_block(logprobs, response_lens, resp_width, "logprobs",
                                                                    names)
    _check_values(loss_mask_t, rewards_t, logprobs_t, names)
    return sequences, attention_mask, response_mask, rewards_t, loss_mask_t, logprobs_t


def _check_values(loss_mask: torch.Tensor, rewards: torch.Tensor, logprobs: torch.Tensor | None,
                  names: Mapping[str, str]) -> None:
    """Vectorized value checks on the ``[B, R]`` blocks: binary loss masks, finite rewards and log-probs."""
    not_binary = ((loss_mask != 0) & (loss_mask != 1)).any(dim=1)
    if not_binary.any():
        i = int(not_binary.nonzero()[0])
        raise ValueError(f"{names['loss_masks']}[{i}] holds values other than 0 and 1: a loss mask selects tokens, it does "
                         "not weight them (the reduction lives in the advantages); use 0/1.")
    for name, block in (("rewards", rewards), ("logprobs", logprobs)):
        if block is None:
            continue
        bad = ~torch.isfinite(block).all(dim=1)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{names[name]}[{i}] holds a NaN or infinite value: fix the generator/reward function.")


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> ``(input_ids [n, S] int64, attention_mask [n, S] int64)``, each row right-aligned
    after ``pad_token_id`` padding (docs/DESIGN.md section 2), ``S`` the longest row. The one left-padding routine
    for id lists (``convert_prompts_responses_to_batch_tensors`` uses the same block writer)."""
    lengths = _lengths(rows)  # [n]
    width = int(lengths.max())
    input_ids = _right_aligned_block(((row,) for row in rows), lengths, width, pad_token_id, np.int64)
    return input_ids, right_aligned_mask(torch.from_numpy(lengths), width)


def right_aligned_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` int64 mask whose row i has its last ``lengths[i]`` columns set."""
    columns = torch.arange(width, device=lengths.device)
    return (columns[None, :] >= (width - lengths)[:, None]).long()


def response_values(x: torch.Tensor, response_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample response values ``x[i, -r_i:]`` with ``r_i = response_mask[i].sum()`` (``x`` is ``[B, R]``).

    Rows with ``r_i = 0`` (DP padding rows) give empty tensors.
    """
    assert x.shape[:2] == response_mask.shape, (tuple(x.shape), tuple(response_mask.shape))
    lengths = response_mask.sum(dim=1)
    width = response_mask.shape[1]
    right_aligned = right_aligned_mask(lengths, width).bool()
    return list(torch.split(x[right_aligned], lengths.tolist()))


def _check_row_counts(names: Mapping[str, str], **fields: Sequence[Any] | None) -> None:
    num_rows = len(fields["prompts"])
    if num_rows == 0:
        raise ValueError(f"{names['prompts']} is empty: a batch needs at least one sequence.")
    for name, rows in fields.items():
        if rows is not None and len(rows) != num_rows:
            raise ValueError(f"{names[name]} has {len(rows)} rows but {names['prompts']} has {num_rows}: give one "
                             "entry per sequence.")


def _lengths(rows: Sequence[Sequence[Any]]) -> np.ndarray:
    return np.fromiter(map(len, rows), np.int64, count=len(rows))  # [B]


def _row_lengths(rows: Sequence[Sequence[Any]], name: str) -> np.ndarray:
    lengths = _lengths(rows)
    empty = np.flatnonzero(lengths == 0)
    if len(empty) > 0:
        raise ValueError(
            f"{name}[{int(empty[0])}] is empty: every sequence needs at least one prompt token and one response "
            "token (see megatron_rl/data/generator_output.py)."
        )
    return lengths


def _warn_if_too_long(total_lens: np.ndarray, max_seq_len: int | None) -> None:
    if max_seq_len is None:
        return
    too_long = int((total_lens > max_seq_len).sum())
    if too_long:
        warnings.warn(
            f"{too_long} sequence(s) exceed max_seq_len={max_seq_len} (longest {int(total_lens.max())} tokens); "
            "they are kept whole, not truncated. Raise max_seq_len or shorten generation.",
            stacklevel=3,
        )


def _right_aligned_block(
    rows: Iterable[Iterable[Sequence[float]]], lengths: np.ndarray, width: int, fill: float, dtype: type
) -> torch.Tensor:
    """``[B, width]`` block: row i = ``fill`` padding, then the pieces of ``rows[i]`` (``lengths[i]`` values).

    One ``np.concatenate`` writes the whole block (row-major = pad_0, pieces_0, pad_1, pieces_1, ...).
    """
    pad = np.full(width, fill, dtype=dtype)
    pieces: list[np.ndarray] = []
    for row_pieces, length in zip(rows, lengths.tolist()):
        pieces.append(pad[: width - length])
        pieces.extend(_as_array(piece, dtype) for piece in row_pieces)
    out = np.empty((len(lengths), width), dtype=dtype)
    np.concatenate(pieces, out=out.reshape(-1))
    return torch.from_numpy(out)


def _as_array(piece: Sequence[float], dtype: type) -> np.ndarray:
    """``piece`` as ``dtype``; token ids (an integer ``dtype``) must be integers, never silently truncated."""
    if not np.issubdtype(dtype, np.integer):
        return np.asarray(piece, dtype=dtype)
    array = np.asarray(piece)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {array.dtype} values such as {array.flat[0]!r} "
                         "(prompt_token_ids / response_ids); convert them with int() in the generator.")
    return array.astype(dtype, copy=False)


def _token_aligned_block(
    rows: Sequence[Sequence[float]], response_lens: np.ndarray, width: int, name: str, names: Mapping[str, str]
) -> torch.Tensor:
    """``[B, R]`` float32 per-token values right-aligned like the responses (lengths checked first)."""
    _check_token_lengths(rows, response_lens, name, names)
    return _right_aligned_block(((row,) for row in rows), response_lens, width, 0.0, np.float32)


def _check_token_lengths(
    rows: Sequence[Sequence[float]], response_lens: np.ndarray, name: str, names: Mapping[str, str],
    row_ids: list[int] | None = None,
) -> None:
    """ValueError unless ``len(rows[j]) == response_lens[j]``; ``row_ids`` maps a subset back to batch rows."""
    lengths = _lengths(rows)
    bad = np.flatnonzero(lengths != response_lens)
    if len(bad) > 0:
        j = int(bad[0])
        i = row_ids[j] if row_ids is not None else j
        raise ValueError(
            f"{names[name]}[{i}] has length {int(lengths[j])} but {names['responses']}[{i}] has length "
            f"{int(response_lens[j])}: "
            "give one value per response token."
        )


def _rewards_block(rewards: Sequence[float | Sequence[float]], response_lens: np.ndarray, width: int,
                   names: Mapping[str, str]) -> torch.Tensor:
    """``[B, R]`` float32: a scalar reward is a one-value row (so it lands on column R-1), per-token rewards are
    right-aligned like the responses."""
    scalar = np.fromiter(map(is_scalar_reward, rewards), bool, count=len(rewards))
    token_rows = np.flatnonzero(~scalar).tolist()
    _check_token_lengths([rewards[i] for i in token_rows], response_lens[token_rows], "rewards", names,
                          token_rows)
    rows = (((r,),) if s else (r,) for r, s in zip(rewards, scalar.tolist()))
    return _right_aligned_block(rows, np.where(scalar, 1, response_lens), width, 0.0, np.float32)


class TrainingBatch:
    """Tensors with leading dim ``B`` plus per-row metadata (docs/INTERFACES.md, "data/").

    Standard keys: ``sequences [B,S] int64``, ``attention_mask [B,S] int64``, ``response_mask [B,R] int64``,
    ``loss_mask [B,R] float32``, ``rewards [B,R] float32``; optional ``rollout_logprobs``, ``old_logprobs``,
    ``ref_logprobs``, ``advantages``, ``returns``, ``values`` (``[B,R] float32``), ``routed_experts``
    (``[B,S,L,k]`` integer, left-padded like ``sequences``: MoE routing replay, model/router_replay.py),
    ``teacher_ids`` (``[B]`` int64: the distillation teacher of each row, -1 none; distillation/signal.py).
    Per-token tensors are right-aligned (docs/DESIGN.md section 2), so widening one means left-padding it.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        uids: Sequence[Hashable],
        trajectory_ids: Sequence[Hashable],
        is_last_step: Sequence[bool],
    ) -> None:
        self.uids = list(uids)
        self.trajectory_ids = list(trajectory_ids)
        self.is_last_step = list(is_last_step)
        for name in ("trajectory_ids", "is_last_step"):
            if len(getattr(self, name)) != len(self.uids):
                raise ValueError(
                    f"TrainingBatch {name} has {len(getattr(self, name))} entries but uids has {len(self.uids)}: "
                    "give one entry per row."
                )
        self.tensors: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            self[key] = value

    def __len__(self) -> int:
        return len(self.uids)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.dim() == 0 or value.shape[0] != len(self):
            raise ValueError(
                f"TrainingBatch[{key!r}] has shape {tuple(value.shape)} but the batch has {len(self)} rows: every "
                "tensor needs leading dimension B."
            )
        self.tensors[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.tensors.items())
        return f"TrainingBatch(B={len(self)}, {shapes})"

    def slice(self, start: int, end: int) -> TrainingBatch:
        """Rows ``[start, end)`` (tensor views; widths unchanged)."""
        return TrainingBatch(
            {k: v[start:end] for k, v in self.tensors.items()},
            self.uids[start:end],
            self.trajectory_ids[start:end],
            self.is_last_step[start:end],
        )

    @staticmethod
    def concat(batches: Sequence[TrainingBatch], pad_token_id: int = 0) -> TrainingBatch:
        """Stack rows of ``batches``; narrower per-token tensors are left-padded (``sequences`` with
        ``pad_token_id``, everything else with 0)."""
        if not batches:
            raise ValueError("TrainingBatch.concat got an empty list: pass at least one batch.")
        keys = batches[0].keys()
        for j, batch in enumerate(batches):
            if set(batch.keys()) != set(keys):
                raise ValueError(
                    f"TrainingBatch.concat: batch {j} has keys {sorted(batch.keys())} but batch 0 has {sorted(keys)}: "
                    "all batches need the same tensors."
                )
        tensors = {k: _left_pad_cat([b[k] for b in batches], pad_token_id if k == SEQUENCE_KEY else 0) for k in keys}
        return TrainingBatch(
            tensors,
            [u for b in batches for u in b.uids],
            [t for b in batches for t in b.trajectory_ids],
            [s for b in batches for s in b.is_last_step],
        )

    def pad_to_multiple(self, k: int, pad_token_id: int) -> tuple[TrainingBatch, int]:
        """Append dummy rows until ``len`` is a multiple of ``k``; returns ``(batch, num_pad_rows)``.

        A dummy row is one ``pad_token_id`` token with attention_mask 1 (a minimal valid sequence), and zeros
        everywhere else (loss_mask, response_mask, advantages, rewards, logprobs ...); its metadata is uid
        ``None``, trajectory id ``None``, ``is_last_step=True``. Works for any ``num_pad_rows`` (even > B).
        """
        if k < 1:
            raise ValueError(f"pad_to_multiple: k={k} must be >= 1 (e.g. the data-parallel size).")
        num_pad = -len(self) % k
        if num_pad == 0:
            return self.slice(0, len(self)), 0  # a new container: callers may add keys without touching self
        dummy = TrainingBatch(
            {key: dummy_rows(key, t, num_pad, pad_token_id) for key, t in self.tensors.items()},
            [None] * num_pad,
            [None] * num_pad,
            [True] * num_pad,
        )
        return TrainingBatch.concat([self, dummy], pad_token_id), num_pad

    def to(self, device: torch.device | str) -> TrainingBatch:
        return TrainingBatch(
            {k: v.to(device) for k, v in self.tensors.items()}, self.uids, self.trajectory_ids, self.is_last_step
        )

    @staticmethod
    def from_generator_output(
        out: GeneratorOutput,
        pad_token_id: int,
        max_seq_len: int | None = None,
        step_wise: bool = False,
        *,
        validated: bool = False,
    ) -> TrainingBatch:
        """Validate ``out`` and convert it. Without ``step_wise`` each sequence is its own trajectory (id = its
        index, ``is_last_step=True``), whatever trajectory ids / is_last_step the generator filled in.

        ``validated=True`` skips ``validate_generator_output``: the caller validated once at its entry (the
        Trainer), or ``out`` comes from ``merge_stepwise_output`` of validated rollouts (valid by construction).
        """
        if not validated:
            out = validate_generator_output(out, step_wise)
        sequences, attention_mask, response_mask, rewards, loss_mask, logprobs = (
            convert_prompts_responses_to_batch_tensors(
                pad_token_id,
                out["prompt_token_ids"],
                out["response_ids"],
                out["rewards"],
                out["loss_masks"],
                out.get("rollout_logprobs"),
                max_seq_len,
                names=GENERATOR_OUTPUT_NAMES,
            )
        )
        tensors = {
            SEQUENCE_KEY: sequences,
            ATTENTION_MASK_KEY: attention_mask,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rewards": rewards,
        }
        if logprobs is not None:
            tensors["rollout_logprobs"] = logprobs
        if out.get("routed_experts") is not None:
            tensors["routed_experts"] = routed_experts_block(out["routed_experts"], sequences.shape[1])
        if out.get("teacher_ids") is not None:
            tensors["teacher_ids"] = torch.tensor(out["teacher_ids"], dtype=torch.int64)  # [B]
        if out.get("images") is not None:
            from megatron_rl.data.mrope import batch_images

            tensors["pixel_values"], tensors["image_grid_thw"] = batch_images(out["images"])
        num_seqs = len(out["uids"])
        if step_wise:
            return TrainingBatch(tensors, out["uids"], out["trajectory_ids"], out["is_last_step"])
        # Without step-wise training every sequence is its own trajectory, whatever the generator filled in.
        return TrainingBatch(tensors, out["uids"], list(range(num_seqs)), [True] * num_seqs)


def routed_experts_block(rows: Sequence[np.ndarray], width: int) -> torch.Tensor:
    """``[B, S, L, k]`` routing (MoE replay R3): row i's ``[n_i, L, k]`` array right-aligned like ``sequences``,
    padding columns 0 (any valid expert). uint8 while every id fits (the replay path's table dtype, up to 256
    experts), else int32."""
    arrays = [np.asarray(row) for row in rows]
    dtype = np.uint8 if max(int(a.max()) if a.size else 0 for a in arrays) < 256 else np.int32
    block = np.zeros((len(arrays), width, *arrays[0].shape[1:]), dtype=dtype)
    for i, array in enumerate(arrays):
        block[i, width - len(array):] = array
    return torch.from_numpy(block)


def _left_pad_cat(tensors: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Concatenate along dim 0, left-padding dim 1 (the right-aligned token dim) to the widest."""
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        if t.shape[1] < width:
            pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
            t = torch.cat([pad, t], dim=1)
        padded.append(t)
    return torch.cat(padded)


def dummy_rows(key: str, like: torch.Tensor, num_rows: int, pad_token_id: int) -> torch.Tensor:
    """``num_rows`` padding rows for tensor ``key`` (see ``TrainingBatch.pad_to_multiple``)."""
    rows = torch.zeros((num_rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    if key == SEQUENCE_KEY:
        rows.fill_(pad_token_id)
    elif key == ATTENTION_MASK_KEY:
        rows[:, -1] = 1
    return rows
