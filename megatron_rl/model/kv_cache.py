"""KV cache for the built-in engine's incremental decoding through the Megatron model (THD packs).

Place in the data flow: ``MegatronPolicy.next_token_logprobs(..., kv_cache=cache)`` (the built-in sampler,
``inference/builtin_engine.py``). One ``KVCache`` lives for one ``generate`` call; its rows are the call's rows
(global row index of the DP-padded batch = the cache key), fixed for the whole call, so every row stays on the
same DP rank from the prefill to the last token:

    prefill   each row's prompt tokens            positions 0 .. p-1        keys/values stored per layer
    decode    one new token per row (a stopped    position = tokens cached  attends to the cached keys + its own
              row's is ignored by the sampler)

How it reaches the attention without megatron-core's inference context: ``attach`` swaps each micro-batch's
pack for a ``CachedPack`` whose ``packed_seq_params()`` is a ``CachedPackParams`` (``PackedRopeParams`` + the
cache, each packed sequence's row and cached length). RoPE reads its per-token positions from there
(``model/rotary.py``: positions offset by the cached length), the rotary table is built for ``max_seqlen`` =
the longest cached + new length, and ``PackedDotProductAttention._thd`` hands the call to ``KVCache.attend``,
keyed by the layer's ``layer_number`` (global, so pipeline stages never collide). Tensor parallelism caches each
rank's own heads; sequence parallelism pads every row's new tokens to the alignment (the padding tokens are never
cached and never attended to: they come after the row's real tokens). Context parallelism is not supported (the
engine then decodes without the cache).

A vision-language policy's rows (``model/vision_policy.py``: each micro-batch a ``data/mrope.py: VisionPack``,
3-D positions and images) go the same way as a ``CachedVisionPack``: the prefill runs the prompts with their
images through the whole model (the vision tower once, its outputs in the image tokens' keys/values) at their
3-D positions; each row's ``rope_deltas`` entry is then its next position minus its cached length (<= 0: an image
of t x h x w merged tokens advances the positions by max(h, w) only), and a decoded token of cached length c
takes the position c + delta on all three rows (transformers' ``rope_deltas`` in ``Qwen2_5_VLModel.forward``).

Exactness: the cached keys/values are those the full forward computes for the same tokens at the same positions
(same weights, same RoPE positions); the new queries attend to exactly the keys the causal full forward gives
them. Only float rounding differs (matmuls over a different number of rows, one softmax row at a time), tested in
``tests/inference/test_kv_cache.py`` against the full forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from megatron_rl.data.mrope import VisionPack
from megatron_rl.data.packing import PackedBatch
from megatron_rl.model.rotary import PackedRopeParams
from megatron_rl.model.vision_language import MropeParams


@dataclass
class CachedPackParams(PackedRopeParams):
    """``PackedRopeParams`` of a pack whose sequences continue cached ones."""

    kv_cache: KVCache | None = None
    rows: list[int | None] = field(default_factory=list)
    """Per packed sequence: its cache key (global row), or None for a DP/micro-batch dummy (never cached)."""
    new_lens: list[int] = field(default_factory=list)
    """Per packed sequence: its real new tokens (the pack's align padding after them is not cached)."""
    layout: "_Layout | None" = field(default=None, init=False, repr=False, compare=False)
    """Set by the forward's first attention layer (``KVCache.attend``), read by the others."""


@dataclass(frozen=True)
class _Layout:
    """Where a forward's new tokens go in the cache and what each attends to: the same in every layer, so the
    forward's first layer computes it once (one host sync of ``cu_seqlens_q`` a forward instead of one a layer
    on a GPU, and the index tensors built once)."""

    bounds: list[int]
    slots: list[int]
    past: list[int]
    width: list[int]
    slot_t: torch.Tensor | None = None
    """Decoding (every sequence ``m`` new tokens): ``[b]`` the rows' cache slots."""
    pos: torch.Tensor | None = None
    """``[b, m]`` the new tokens' cache positions."""
    visible: torch.Tensor | None = None
    """``[b, m, span]`` bool: what each new token attends to."""
    token_slot: torch.Tensor | None = None
    """A first prefill (nothing cached, sequences of different lengths): ``[bounds[-1]]`` each token's slot."""
    token_pos: torch.Tensor | None = None
    """... and its cache position."""


VISION_FIELDS = ("mrope_section", "mrope_interleaved", "pixel_values", "image_grid_thw", "image_mask")
"""What a ``VisionPack`` hands its ``MropeParams`` beside the positions (the same names on both)."""


@dataclass
class CachedMropeParams(MropeParams, CachedPackParams):
    """``MropeParams`` (3-D positions; the prefill's images) of a pack whose sequences continue cached ones."""


@dataclass
class CachedPack(PackedBatch):
    """A ``PackedBatch`` of new tokens, positions offset by each row's cached length (see the module doc)."""

    kv_cache: KVCache | None = None
    rows: list[int | None] = field(default_factory=list)
    rope_max_seqlen: int = 0
    """Longest (cached + new, align-padded) sequence: the length of the rotary table."""

    def packed_seq_params(self) -> CachedPackParams:
        return CachedPackParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.rope_max_seqlen, max_seqlen_kv=self.rope_max_seqlen,
            position_ids=self.position_ids.reshape(-1), kv_cache=self.kv_cache, rows=self.rows,
            new_lens=self.seq_lens.tolist(),
        )  # fmt: skip


class KVCache:
    """Per layer, the keys and values (after RoPE, this rank's heads) of every token decoded so far: one buffer
    ``[slots, capacity, ng, hn]`` per layer, a slot per row (and per dummy row of the current call)."""

    def __init__(self) -> None:
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: dict[object, int] = {}
        self.lengths: dict[int, int] = {}
        """Tokens cached per row (the same in every layer once a forward has finished)."""
        self.rope_deltas: dict[int, int] = {}
        """Per row of a vision-language pack: its next 3-D position (all three rows) minus its cached length."""
        self._pending: dict[int, int] = {}
        self._pending_deltas: dict[int, int] = {}

    def attach(self, call, num_rows: int) -> None:
        """Make ``call``'s micro-batches (``model/plan.py CallPlan``) continue the cached rows: positions offset by
        each row's cached length, the cache in their params. Rows ``>= num_rows`` are DP padding: never cached.
        Records each real row's new length; ``commit`` (after the forward) adds it to ``lengths``."""
        max_len = 1
        packs = []
        for item in call.microbatches:
            packed = item.packed
            assert item.cp_local is None, "the KV cache does not support context parallelism"
            rows = [r if r < num_rows else None for r in item.rows] if item.rows else [None] * packed.num_rows
            offsets = torch.tensor([self.lengths.get(r, 0) if r is not None else 0 for r in rows], dtype=torch.long)
            seg = packed.cu_seqlens.cpu().diff()[: packed.num_rows].long()  # align-padded new lengths
            per_token = torch.zeros(packed.total_len, dtype=torch.long)  # a dummy tail sequence keeps offset 0
            per_token[: int(seg.sum())] = torch.repeat_interleave(offsets, seg)
            position_ids = packed.position_ids + per_token.to(packed.position_ids.device)[None]
            max_len = max(max_len, int((offsets + seg).max()), packed.max_seqlen)
            for r, n in zip(rows, packed.seq_lens.tolist()):
                if r is not None:
                    self._pending[r] = n
            mrope = None
            if isinstance(packed, VisionPack):
                mrope = self._mrope_positions(packed, rows, offsets, seg, per_token)
            packs.append((item, _cached_pack(packed, position_ids, rows, self, mrope)))
        for item, pack in packs:
            item.packed = replace(pack, rope_max_seqlen=max_len)

    def _mrope_positions(self, packed: VisionPack, rows: list[int | None], offsets: torch.Tensor,
                         seg: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
        """``[3, T]``: the pack's 3-D positions (each sequence's from 0) moved by each row's cached length and rope
        delta; records each row's delta after these tokens (its next position minus its new cached length)."""
        deltas = torch.tensor([self.rope_deltas.get(r, 0) if r is not None else 0 for r in rows], dtype=torch.long)
        shift = per_token.clone()
        shift[: int(seg.sum())] += torch.repeat_interleave(deltas, seg)
        mrope = packed.mrope_positions + shift.to(packed.mrope_positions.device)[None]
        if packed.image_grid_thw is None:  # text only (every decoding step): each token advances all rows by one,
            return mrope                   # the deltas stay (and no device sync)
        starts = packed.cu_seqlens.cpu()[:-1].tolist()
        for i, (r, n) in enumerate(zip(rows, packed.seq_lens.tolist())):
            if r is not None and n > 0:
                after = int(mrope[:, starts[i]:starts[i] + n].max()) + 1  # the row's next position
                self._pending_deltas[r] = after - (int(offsets[i]) + n)
        return mrope

    def commit(self) -> None:
        """The forward of the attached call finished: its new tokens are cached."""
        for r, n in self._pending.items():
            self.lengths[r] = self.lengths.get(r, 0) + n
        self.rope_deltas.update(self._pending_deltas)
        self._pending.clear()
        self._pending_deltas.clear()

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               params: CachedPackParams, attention) -> torch.Tensor:
        """q ``[T, np, hn]``, k/v ``[T, ng, hn]`` of the new tokens -> ``[T, np*hn]``: each sequence's new queries
        attend causally to its cached keys and its new ones, which are written to the cache (a row's length only
        advances by its real new tokens: align padding is overwritten later). ``attention``: the layer's
        ``PackedDotProductAttention``, whose ``_sdpa(q, k, v, mask, causal)`` (``[s, b, h, hn]``, boolean mask:
        True = attend) and ``packed_causal`` (a first prefill: nothing cached yet) do the arithmetic."""
        sdpa = attention._sdpa
        if params.layout is None:
            params.layout = self._layout(params, key.device)
        layout = params.layout
        bounds, slots, past, width = layout.bounds, layout.slots, layout.past, layout.width
        starts, ends = bounds[:-1], bounds[1:]
        k_buf, v_buf = self._buffer(layer_number, key, max(p + m for p, m in zip(past, width)))
        if layout.slot_t is not None:  # decoding: m new tokens per sequence, one batched call
            b, m = len(width), width[0]
            slot_t, pos, visible = layout.slot_t, layout.pos, layout.visible
            k_buf[slot_t[:, None], pos] = key[: b * m].view(b, m, *key.shape[1:])
            v_buf[slot_t[:, None], pos] = value[: b * m].view(b, m, *value.shape[1:])
            span = visible.shape[-1]
            k_all, v_all = k_buf[slot_t, :span], v_buf[slot_t, :span]  # [b, span, ng, hn]
            q = query[: b * m].view(b, m, *query.shape[1:])
            out = sdpa(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1), visible[:, None],
                       causal=False)  # [m, b, np*hn]
            outs = [out.transpose(0, 1).reshape(b * m, -1)]
        elif layout.token_slot is not None:  # a first prefill: each sequence causal over its own new tokens
            k_buf[layout.token_slot, layout.token_pos] = key[: bounds[-1]]
            v_buf[layout.token_slot, layout.token_pos] = value[: bounds[-1]]
            outs = [attention.packed_causal(query, key, value, bounds)]
        else:  # prefill after cached tokens (sequences of different lengths): one call per sequence
            outs = []
            for s, e, slot, p in zip(starts, ends, slots, past):
                if e == s:
                    continue
                k_buf[slot, p:p + e - s], v_buf[slot, p:p + e - s] = key[s:e], value[s:e]
                k_all, v_all = k_buf[slot, : p + e - s, None], v_buf[slot, : p + e - s, None]
                mask = None if p == 0 else torch.ones(e - s, p + e - s, dtype=torch.bool,
                                                      device=query.device).tril(diagonal=p)
                outs.append(sdpa(query[s:e, None], k_all, v_all, mask, causal=p == 0)[:, 0])
        total = query.shape[0]
        if bounds[-1] < total:
            outs.append(query.new_zeros(total - bounds[-1], query.shape[1] * query.shape[2]))
        return torch.cat(outs, dim=0)

    def _layout(self, params: CachedPackParams, device: torch.device) -> _Layout:
        bounds = params.cu_seqlens_q.tolist()
        starts, ends = bounds[:-1], bounds[1:]
        keys = [params.rows[i] if i < len(params.rows) and params.rows[i] is not None else ("dummy", i)
                for i in range(len(starts))]
        slots = [self._slot(k) for k in keys]
        past = [self.lengths.get(k, 0) if isinstance(k, int) else 0 for k in keys]
        width = [e - s for s, e in zip(starts, ends)]
        if not (len(set(width)) == 1 and width[0] > 0):  # prefill
            if any(past):  # after cached tokens: one call per sequence
                return _Layout(bounds, slots, past, width)
            token_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(width))  # [bounds[-1]]
            token_pos = torch.cat([torch.arange(n) for n in width])
            return _Layout(bounds, slots, past, width, token_slot=token_slot.to(device),
                           token_pos=token_pos.to(device))
        pos = torch.tensor(past, device=device)[:, None] + torch.arange(width[0], device=device)  # [b, m]
        span = max(past) + width[0]
        visible = torch.arange(span, device=device)[None, None, :] <= pos[:, :, None]  # [b, m, span]
        return _Layout(bounds, slots, past, width, torch.tensor(slots, device=device), pos, visible)

    def _slot(self, key: object) -> int:
        if key not in self._slots:
            self._slots[key] = len(self._slots)
        return self._slots[key]

    def _buffer(self, layer_number: int, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers, grown (doubling) to every slot and at least ``length`` positions."""
        slots = len(self._slots)
        k_buf, v_buf = self._buffers.get(layer_number, (None, None))
        if k_buf is None or k_buf.shape[0] < slots or k_buf.shape[1] < length:
            old = k_buf
            shape = (max(slots, 2 * old.shape[0] if old is not None else slots),
                     max(length, 2 * old.shape[1] if old is not None else length), *like.shape[1:])
            k_new, v_new = like.new_zeros(shape), like.new_zeros(shape)
            if old is not None:
                k_new[: old.shape[0], : old.shape[1]] = old
                v_new[: old.shape[0], : old.shape[1]] = v_buf
            self._buffers[layer_number] = k_buf, v_buf = k_new, v_new
        return k_buf, v_buf


@dataclass
class CachedVisionPack(VisionPack, CachedPack):
    """A ``VisionPack`` (its ``mrope_positions`` offset like ``position_ids``) continuing cached rows."""

    def packed_seq_params(self) -> CachedMropeParams:
        cached = CachedPack.packed_seq_params(self)
        params = {f.name: getattr(cached, f.name) for f in fields(cached) if f.init}
        params.update({name: getattr(self, name) for name in VISION_FIELDS}, position_ids=self.mrope_positions)
        return CachedMropeParams(**params)


def _cached_pack(packed: PackedBatch, position_ids: torch.Tensor, rows: list[int | None],
                 cache: KVCache, mrope_positions: torch.Tensor | None = None) -> CachedPack:
    """``packed`` as a ``CachedPack`` with the given positions (a ``VisionPack``: a ``CachedVisionPack``)."""
    names = ("input_ids", "labels", "label_mask", "cu_seqlens", "seq_lens", "max_seqlen")
    if mrope_positions is None:
        return CachedPack(**{n: getattr(packed, n) for n in names}, position_ids=position_ids, kv_cache=cache,
                          rows=rows)
    vision = {f.name: getattr(packed, f.name) for f in fields(VisionPack)}
    return CachedVisionPack(**{**vision, "position_ids": position_ids, "mrope_positions": mrope_positions},
                            kv_cache=cache, rows=rows)
