"""RoPE for packed (THD) micro-batches from per-token positions: no host sync, cos/sin once per micro-batch.

Why (docs/DESIGN.md section 12, GPU path): megatron-core's THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``,
0.16.1 and 0.19.2) splits the pack per sequence with ``cu_seqlens.tolist()`` (and ``.item()`` per sequence
when the table covers the whole pack), for q and for k, in every layer: 2 x layers host syncs per micro-batch
and one small kernel chain per sequence, and it recomputes ``cos``/``sin`` each time.

What runs instead, in the local layer spec (``model/builder.py``; the TE spec keeps megatron's RoPE):

    GPTModel                     builds its rotary table once per forward (RotaryEmbedding: freqs [S_max,1,1,D])
    PackedRopeParams             megatron's PackedSeqParams + ``position_ids [T]`` (the pack's per-token
                                 positions, restarting per sequence; under context parallelism the GLOBAL
                                 positions of this rank's tokens), built by ``PackedBatch.packed_seq_params``
    PackedRopeSelfAttention      takes the table out of megatron's path; right after
                                 ``get_query_key_value_tensors`` (after the q/k norm: where megatron applies
                                 RoPE) applies ``t * cos + rotate_half(t) * sin`` to q and k, with ``cos``/``sin``
                                 = table[position_ids] computed on the device once per micro-batch and dtype
                                 (cached on the params object that every layer of the chunk shares)

Exactness: megatron's unfused THD path also gathers the table per token into a ``[T, 1, 1, D]`` tensor and then
computes ``(cos(freqs) * mscale).to(dtype)`` and ``t * cos_ + rotate_half(t) * sin_``; the same operations on
tensors of the same shapes give bitwise the same q and k (tested against megatron's function on CPU, fp32 and
bf16). Without ``position_ids`` (a plain ``PackedSeqParams``), megatron's own RoPE runs unchanged.

Workaround W15 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when megatron's THD RoPE takes per-token
positions (or cu_seqlens) without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention


@dataclass
class PackedRopeParams(PackedSeqParams):
    """``PackedSeqParams`` (qkv_format "thd") that also carries what our local layers read per micro-batch: the
    pack's per-token RoPE positions and, under context parallelism, the global order of the CP gather."""

    position_ids: torch.Tensor | None = None
    """``[T]`` int64 on the model's device: the position of each packed token within its own sequence."""
    cp_order: torch.Tensor | None = None
    """Context parallelism only (``data.packing.CPLocalPack``): ``[T]`` global pack position -> row of the
    rank-major K/V all-gather, computed once per micro-batch for every layer's attention."""
    rope_cache: dict = field(default_factory=dict, repr=False, compare=False)
    """``{(table id, dtype): (cos, sin)}`` filled by the first layer of a forward pass, reused by the others."""

    def rope_cos_sin(self, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[T, 1, 1, D]`` in ``dtype`` for ``table [S_max, 1, 1, D]`` (computed once)."""
        key = (id(table), table.shape, dtype)
        if key not in self.rope_cache:
            freqs = table[self.position_ids.reshape(-1)]  # [T, 1, 1, D]: a device gather, no sync
            self.rope_cache[key] = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))  # mscale is 1.0
        return self.rope_cache[key]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (non-interleaved RoPE, as megatron's ``_rotate_half``)."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t [T, b, h, D]`` rotated by ``cos``/``sin`` ``[T, 1, 1, D_rot]`` (the first ``D_rot`` channels)."""
    rot_dim = cos.shape[-1]
    if rot_dim == t.shape[-1]:
        return t * cos + rotate_half(t) * sin
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t * cos + rotate_half(t) * sin, t_pass), dim=-1)


class PackedRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose RoPE, for ``PackedRopeParams`` input, comes from per-token positions."""

    _rope: tuple[torch.Tensor, PackedRopeParams] | None = None

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        table = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
        if (table is not None and isinstance(packed_seq_params, PackedRopeParams)
                and packed_seq_params.position_ids is not None):  # fmt: skip
            if isinstance(rotary_pos_emb, tuple) and rotary_pos_emb[1] is not rotary_pos_emb[0]:
                raise ValueError("PackedRopeSelfAttention expects one rotary table for queries and keys")
            if self.config.rotary_interleaved or getattr(self.config, "multi_latent_attention", False):
                raise ValueError("per-token packed RoPE supports non-interleaved, non-MLA rotary only")
            self._rope, rotary_pos_emb = (table, packed_seq_params), None
        try:
            return super().forward(
                hidden_states, *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kwargs
            )
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return out
        table, params = self._rope
        query, key = out[0], out[1]  # [T, 1, np, hn], [T, 1, ng, hn] (split q/k/v: packed input never fuses)
        cos, sin = params.rope_cos_sin(table, query.dtype)
        return (apply_rope(query, cos, sin), apply_rope(key, cos, sin), *out[2:])
