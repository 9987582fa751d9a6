"""Padding removal: left-padded micro-batch rows -> one THD packed stream, and per-token outputs back.

Place in the data flow (docs/DESIGN.md sections 1 and 3): per micro-batch, right before the Megatron forward pass
(``pack``), and right after it (``unpack_response``). Pure tensor code; megatron-core is imported lazily and
only by ``PackedBatch.packed_seq_params``.

    row i valid tokens v_0 .. v_{n_i-1} (attention_mask == 1), padded at its END to n_i' (multiple of align)
    input_ids    [1, T]   v_0 v_1 .. v_{n-1} pad .. | next row ...       T = sum_i n_i'
    position_ids [1, T]   0   1   ..  n-1    n  ..  | 0 ...             (restart per sequence)
    labels       [1, T]   v_1 v_2 .. 0       0  ..  | ...               (next token of the SAME sequence)
    label_mask   [1, T]   1   1   .. 0       0  ..  | ...
    cu_seqlens   [b+1]    0, n_0', n_0'+n_1', ...   int32

Labels are built per sequence, never by rolling the flat stream, so no label crosses a boundary. With
``target_len`` (pipeline parallelism with equal micro-batch lengths) the pack is extended by one final dummy
sequence (label_mask 0) that appears in ``cu_seqlens`` (then ``b+2`` entries) but not in ``seq_lens``.

Context parallelism (docs/DESIGN.md "Context parallelism"): ``split_for_cp`` cuts every packed sequence (each
a multiple of ``2*cp``, see ``packing_alignment``) into ``2*cp`` equal chunks; CP rank r keeps chunks r and
``2*cp-1-r`` of every sequence, in pack order (load-balanced causal work, megatron-core's THD layout):

    sequence of n tokens, cp=2, c = n/4:   | c0 | c1 | c2 | c3 |      rank 0: c0 c3    rank 1: c1 c2
    local pack (T/cp tokens)               ids, labels, label_mask of those tokens; position_ids = their
                                           GLOBAL positions in their sequence; cu_seqlens, seq_lens and
                                           max_seqlen stay GLOBAL (megatron's convention under CP)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass
class PackedBatch:
    """One THD packed micro-batch (see the module diagram)."""

    input_ids: torch.Tensor
    """``[1, T]`` int64 tokens, each sequence padded at its end to a multiple of ``align``."""
    position_ids: torch.Tensor
    """``[1, T]`` int64, restarting at 0 for each sequence."""
    labels: torch.Tensor
    """``[1, T]`` int64 next token of the same sequence; 0 where there is none."""
    label_mask: torch.Tensor
    """``[1, T]`` int64, 1 where ``labels`` holds a real next token."""
    cu_seqlens: torch.Tensor
    """``[b+1]`` int32 cumulative align-padded lengths (``[b+2]`` after ``pad_packed_to`` added a dummy)."""
    seq_lens: torch.Tensor
    """``[b]`` int64 real (unpadded) lengths of the rows."""
    max_seqlen: int
    """Longest padded sequence (never the whole pack: RoPE would then offset positions across sequences)."""

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def total_len(self) -> int:
        return int(self.input_ids.shape[1])

    def packed_seq_params(self) -> Any:
        """megatron-core ``PackedSeqParams(qkv_format="thd", ...)`` for this pack, as the subclass
        ``model.rotary.PackedRopeParams`` that also carries ``position_ids`` for RoPE (lazy import)."""
        from megatron_rl.model.rotary import PackedRopeParams

        return PackedRopeParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            position_ids=self.position_ids.reshape(-1),
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        tensors = {
            name: getattr(self, name).to(device, non_blocking=True)
            for name in ("input_ids", "position_ids", "labels", "label_mask", "cu_seqlens", "seq_lens")
        }
        return replace(self, **tensors)


@dataclass
class CPLocalPack(PackedBatch):
    """CP rank ``cp_rank``'s part of a pack (``split_for_cp``): ``input_ids``, ``position_ids``, ``labels``,
    ``label_mask`` are ``[1, T/cp]`` local tokens; ``cu_seqlens``, ``seq_lens``, ``max_seqlen`` describe the GLOBAL
    pack (so ``total_len`` is the local length, ``cu_seqlens[-1]`` the global one)."""

    cp_size: int = 1
    cp_rank: int = 0
    cp_index: torch.Tensor | None = None
    """``[cp, T/cp]`` int64: row r holds the global pack positions of CP rank r's tokens, in local order."""
    cp_order: torch.Tensor | None = None
    """``[T]`` int64 (``cp_global_order``): for each global pack position, its row in a rank-major CP all-gather.
    Computed once per micro-batch; every layer's K/V gather and the output gather reuse it."""

    def packed_seq_params(self) -> Any:
        """The pack's ``PackedSeqParams`` with ``cu_seqlens_*_padded`` set to the (global, padded) cu_seqlens:
        TransformerEngine's CP attention reads the chunk layout from them; the local attention and RoPE
        accept them (the same tensor object, so no comparison is needed)."""
        params = super().packed_seq_params()
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = self.cu_seqlens
        params.cp_order = self.cp_order
        return params

    def to(self, device: torch.device | str) -> CPLocalPack:
        moved = super().to(device)
        return replace(moved, cp_index=self.cp_index.to(device, non_blocking=True),
                       cp_order=self.cp_order.to(device, non_blocking=True))


def cp_token_index(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[cp, T/cp]`` int64: the global pack positions each CP rank holds (module diagram), in local order.

    Row r lists, sequence by sequence, chunk r then chunk ``2*cp-1-r`` (each sequence's ``2*cp`` chunks are
    equal). ValueError for a sequence whose length is not a multiple of ``2*cp``."""
    if cp_size < 1:
        raise ValueError(f"cp_token_index: cp_size={cp_size} must be >= 1.")
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]  # [b]
    bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
    if len(bad) > 0:
        raise ValueError(
            f"cp_token_index: packed sequence {int(bad[0])} has {int(lengths[bad[0]])} tokens, not a multiple of "
            f"2*context_parallel_size={2 * cp_size}; pack with align=packing_alignment(tp, cp, sp)."
        )
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T] sequence of each position
    offset = torch.arange(total) - cu[:-1][seq]  # position within its sequence
    chunk = offset // (lengths[seq] // (2 * cp_size))  # 0 .. 2cp-1
    owner = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)  # [T] CP rank holding the position
    return torch.argsort(owner, stable=True).view(cp_size, total // cp_size)


def cp_global_order(cp_index: torch.Tensor) -> torch.Tensor:
    """``[T]``: the inverse of ``cp_index [cp, T/cp]`` flattened, i.e. the rank-major row of each global position."""
    return torch.argsort(cp_index.reshape(-1))


def split_for_cp(packed: PackedBatch, cp_size: int, cp_rank: int) -> CPLocalPack:
    """CP rank ``cp_rank``'s local pack of ``packed`` (module diagram); host or device, pure indexing.

    Labels were built per global sequence before the split, so every local token keeps the label of its
    global successor. ValueError for a pack not aligned to ``2*cp_size``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"split_for_cp: cp_rank={cp_rank} must be in [0, cp_size={cp_size}).")
    if int(packed.cu_seqlens[-1]) != packed.total_len:
        raise ValueError(
            f"split_for_cp: cu_seqlens[-1]={int(packed.cu_seqlens[-1])} must equal the pack length "
            f"{packed.total_len} (a whole pack from pack(), not a local one)."
        )
    index = cp_token_index(packed.cu_seqlens, cp_size).to(packed.input_ids.device)  # [cp, T/cp]
    mine = index[cp_rank]
    return CPLocalPack(
        input_ids=packed.input_ids[:, mine],
        position_ids=packed.position_ids[:, mine],
        labels=packed.labels[:, mine],
        label_mask=packed.label_mask[:, mine],
        cu_seqlens=packed.cu_seqlens,
        seq_lens=packed.seq_lens,
        max_seqlen=packed.max_seqlen,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_index=index,
        cp_order=cp_global_order(index),
    )


def packing_alignment(tp_size: int, cp_size: int, sequence_parallel: bool) -> int:
    """Per-sequence length multiple: ``2*cp*tp`` with context parallelism (each CP rank takes two chunks, each
    split over TP under SP), ``tp`` with sequence parallelism (the sequence dim is split over TP), else 1."""
    if tp_size < 1 or cp_size < 1:
        raise ValueError(f"packing_alignment: tp_size={tp_size} and cp_size={cp_size} must be >= 1.")
    if cp_size > 1:
        return 2 * cp_size * tp_size
    return tp_size if sequence_parallel else 1


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, align: int = 1, target_len: int | None = None
) -> PackedBatch:
    """Pack the valid tokens of ``input_ids [b, S]`` (where ``attention_mask [b, S]`` is 1) into ``[1, T]``.

    Each row's valid tokens are taken in order and padded at the end to a multiple of ``align``. With
    ``target_len`` the pack is then extended to exactly that length (see ``pad_packed_to``).
    """
    if align < 1:
        raise ValueError(f"pack: align={align} must be >= 1 (see packing_alignment).")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"pack: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both "
            "be [b, S]."
        )
    valid = attention_mask.bool()
    seq_lens = valid.sum(dim=1)  # [b]
    empty = torch.nonzero(seq_lens == 0).flatten()
    if len(empty) > 0:
        raise ValueError(
            f"pack: row {int(empty[0])} has no valid token (attention_mask all 0); padding rows must hold one "
            "token (TrainingBatch.pad_to_multiple does)."
        )
    padded_lens = (seq_lens + align - 1) // align * align  # [b]
    cu_seqlens = torch.zeros(len(seq_lens) + 1, dtype=torch.int64, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(padded_lens, dim=0)
    tokens = input_ids[valid]  # [N], row-major = row by row, in order
    row = torch.repeat_interleave(torch.arange(len(seq_lens), device=input_ids.device), seq_lens)  # [N]
    offset_in_row = torch.arange(len(tokens), device=input_ids.device) - (cu_seq_starts(seq_lens))[row]  # j
    dest = cu_seqlens[:-1][row] + offset_in_row  # [N] packed position of token j of its row
    packed = _build(tokens, dest, offset_in_row < (seq_lens[row] - 1), cu_seqlens, seq_lens, padded_lens)
    return pad_packed_to(packed, target_len) if target_len is not None else packed


def cu_seq_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum: start offset of each segment of ``lengths`` ``[b]`` in a flat stream."""
    return torch.cumsum(lengths, dim=0) - lengths


def _build(
    tokens: torch.Tensor,
    dest: torch.Tensor,
    has_next: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    padded_lens: torch.Tensor,
) -> PackedBatch:
    """Scatter the valid ``tokens [N]`` to packed positions ``dest [N]``; labels from ``tokens[k+1]`` where
    ``has_next[k]`` (the next valid token belongs to the same row)."""
    total = int(cu_seqlens[-1])
    device = tokens.device
    input_ids = torch.zeros(total, dtype=tokens.dtype, device=device)
    input_ids[dest] = tokens
    labels = torch.zeros(total, dtype=tokens.dtype, device=device)
    label_mask = torch.zeros(total, dtype=torch.int64, device=device)
    with_label = dest[has_next]
    labels[with_label] = tokens[1:][has_next[:-1]]
    label_mask[with_label] = 1
    return PackedBatch(
        input_ids=input_ids[None],
        position_ids=_restarting_positions(padded_lens)[None],
        labels=labels[None],
        label_mask=label_mask[None],
        cu_seqlens=cu_seqlens.to(torch.int32),
        seq_lens=seq_lens,
        max_seqlen=int(padded_lens.max()),
    )


def _restarting_positions(lengths: torch.Tensor) -> torch.Tensor:
    """``[sum(lengths)]`` positions 0..len-1 for each consecutive segment."""
    total = int(lengths.sum())
    starts = torch.repeat_interleave(cu_seq_starts(lengths), lengths)
    return torch.arange(total, device=lengths.device) - starts


def pad_packed_to(packed: PackedBatch, total_len: int) -> PackedBatch:
    """Extend ``packed`` to exactly ``total_len`` tokens with one final dummy sequence (label_mask 0).

    The dummy appears in ``cu_seqlens`` (so attention stays block-diagonal) but not in ``seq_lens``. Used when
    pipeline stages need micro-batches of one length. ``total_len`` must keep the pack a multiple of the
    alignment; that is the caller's job (pass a multiple of ``align``).
    """
    extra = total_len - packed.total_len
    if extra < 0:
        raise ValueError(f"pad_packed_to: total_len={total_len} is shorter than the pack ({packed.total_len} tokens).")
    if extra == 0:
        return packed
    device = packed.input_ids.device
    zeros = torch.zeros((1, extra), dtype=packed.input_ids.dtype, device=device)
    end = torch.tensor([total_len], dtype=torch.int32, device=device)
    return replace(
        packed,
        input_ids=torch.cat([packed.input_ids, zeros], dim=1),
        position_ids=torch.cat([packed.position_ids, torch.arange(extra, device=device)[None]], dim=1),
        labels=torch.cat([packed.labels, zeros], dim=1),
        label_mask=torch.cat([packed.label_mask, torch.zeros_like(zeros, dtype=torch.int64)], dim=1),
        cu_seqlens=torch.cat([packed.cu_seqlens, end]),
        max_seqlen=max(packed.max_seqlen, extra),
    )


def unpack_response(values: torch.Tensor, packed: PackedBatch, response_width: int) -> torch.Tensor:
    """Per-token outputs of the pack ``[1, T]`` or ``[T]`` -> right-aligned response values ``[b, R]``.

    Packed position ``cu[i] + j`` is about predicting valid token ``v_{j+1}`` of row i; it goes to response
    column ``k = j - (n_i - R - 1)``, for ``j <= n_i - 2`` (the last token has no label). Columns with no value
    are 0. Differentiable (a gather), so losses on the result backpropagate into the pack.
    """
    flat = values.reshape(-1) if values.dim() == 2 else values
    if flat.dim() != 1 or flat.shape[0] != packed.total_len:
        raise ValueError(
            f"unpack_response: values {tuple(values.shape)} must be [1, T] or [T] with T={packed.total_len}."
        )
    n = packed.seq_lens.to(flat.device)[:, None]  # [b, 1]
    columns = torch.arange(response_width, device=flat.device)[None, :]  # [1, R]
    j = columns + n - response_width - 1  # [b, R] position within the row
    has_value = j >= 0
    index = packed.cu_seqlens[: packed.num_rows].to(device=flat.device, dtype=torch.int64)[:, None] + j.clamp(min=0)
    gathered = flat[index]  # [b, R]
    return torch.where(has_value, gathered, torch.zeros((), dtype=flat.dtype, device=flat.device))
