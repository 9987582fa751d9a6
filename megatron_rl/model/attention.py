"""Portable core attention that accepts packed THD input (P8; docs/DESIGN.md section 3).

megatron-core's local ``DotProductAttention`` rejects ``packed_seq_params``
(``transformer/dot_product_attention.py:153``) and TransformerEngine needs a GPU. This module has the same
constructor and forward signature as ``DotProductAttention`` in 0.16.1 and is put into the local layer spec by
``megatron_rl.model.builder``. Inputs, per TP rank (``np`` query heads, ``ng`` key/value groups, ``hn`` head dim):

    THD (packed_seq_params.qkv_format == "thd"):   q [T, np, hn], k/v [T, ng, hn]  ->  [T, np*hn]
        sequence i occupies rows cu[i]:cu[i+1] (cu_seqlens_q_padded if given, else cu_seqlens_q); each
        sequence attends causally to itself only (block-diagonal causal); rows after cu[-1] give 0 (CPU
        path; the CUDA path requires cu[-1] == T, see below).
    padded (sbhd):                                 q [s, b, np, hn], k/v [s, b, ng, hn]  ->  [s, b, np*hn]
        attention_mask [b|1, 1, s, s] bool, True = masked (megatron's convention); None = causal.

Kernels, chosen by device in ``_thd`` (the CPU result is unchanged by the CUDA path's existence):

    CUDA, fp16/bf16, no dropout   ``torch.nn.attention.varlen.varlen_attn`` (flash) over ``cu_seqlens``: one
                                  kernel for all sequences, causal, GQA native or by expanding k/v on the
                                  device; no host sync (``max_seqlen`` is the Python int of PackedSeqParams).
                                  Requires ``cu_seqlens[-1] == T`` and ``max_seqlen`` >= every sequence, which
                                  ``PackedBatch`` guarantees (checking it here would be a device sync).
    otherwise (CPU, fp32)         torch's scaled_dot_product_attention (GQA via ``enable_gqa``) over host bounds
                                  (``cu.tolist()``, free on CPU): one call over the sequences right-padded to
                                  the longest when they are short or alike (``packed_causal``), else one call
                                  per packed sequence.

Context parallelism (``context_parallel_size`` cp > 1; docs/DESIGN.md "Context parallelism"): q/k/v hold this
CP rank's local tokens (``T/cp`` rows: chunks r and 2cp-1-r of every sequence, ``data.packing.split_for_cp``)
and ``cu_seqlens`` is the GLOBAL padded one. Keys and values are all-gathered over the CP group
(``model.context_parallel.all_gather_cp``, backward = sum over CP ranks, i.e. a reduce-scatter), put back in
global order, and each local query attends causally within its own sequence by GLOBAL position
(``_offset_causal``, per sequence and chunk: on CPU two mask-free flash calls merged by log-sum-exp, O(n)
memory; on CUDA or with dropout SDPA with a boolean mask ``key_pos <= query_pos``; no varlen path under CP).

Either way the cost is ``sum_i n_i**2`` (the padded call: at most twice that, or sequences of <= 256 tokens) rather
than ``T**2``. Masked-out logits get the dtype's most negative
value rather than -inf, so a fully masked (padding) query row yields a finite, ignored output instead of NaN.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.data.packing import cp_global_order, cp_token_index
from megatron_rl.model.context_parallel import all_gather_cp, to_global_order

logger = logging.getLogger(__name__)


# Workaround W5 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when megatron's local attention accepts THD packing.
class PackedDotProductAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` (same arguments) that also accepts THD input."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        _check_supported(config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} but the attention's CP group has "
                f"{self.cp_size} ranks; pass the pg_collection of initialize_distributed"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = config.num_attention_heads // tp_size  # np
        self.num_groups = config.num_query_groups // tp_size  # ng
        assert self.num_heads * tp_size == config.num_attention_heads, "heads not divisible by TP (builder checks)"
        assert self.num_groups * tp_size == config.num_query_groups, "groups not divisible by TP (builder checks)"
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        assert attention_bias is None, "attention_bias is not supported by PackedDotProductAttention"
        with self._dropout_rng():
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._thd(query, key, value, packed_seq_params)
            assert packed_seq_params is None or packed_seq_params.qkv_format == "sbhd", packed_seq_params
            if self.cp_size > 1:
                raise ValueError(
                    f"context_parallel_size={self.cp_size} needs THD packed input (packed_seq_params with "
                    "qkv_format='thd', as MegatronPolicy passes); padded input is not split over CP"
                )
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            return self._padded(query, key, value, attention_mask, causal)

    def _thd(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """q [T, np, hn], k/v [T, ng, hn] -> [T, np*hn], block-diagonal causal over cu_seqlens."""
        if getattr(params, "kv_cache", None) is not None:  # incremental decoding (model/kv_cache.py)
            return params.kv_cache.attend(self.layer_number, query, key, value, params, self)
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_q is not cu_kv:  # PackedBatch passes one tensor for both: no comparison (a device sync) needed
            assert torch.equal(cu_q.cpu(), cu_kv.cpu()), "self-attention expects cu_seqlens_q == cu_seqlens_kv"
        if self.cp_size > 1:
            return self._thd_cp(query, key, value, cu_q, params.max_seqlen_q, getattr(params, "cp_order", None))
        if self._use_varlen(query):
            return self._thd_varlen(query, key, value, cu_q, params.max_seqlen_q)
        bounds = cu_q.tolist()
        total = query.shape[0]
        assert bounds[0] == 0 and bounds[-1] <= total, (bounds, total)
        _check_max_seqlen(params.max_seqlen_q, bounds)
        out = self.packed_causal(query, key, value, bounds)
        if bounds[-1] < total:
            out = torch.cat([out, query.new_zeros(total - bounds[-1], out.shape[-1])], dim=0)
        return out

    def packed_causal(self, query, key, value, bounds: list[int]) -> torch.Tensor:
        """q ``[T, np, hn]``, k/v ``[T, ng, hn]``, host ``bounds`` (cu_seqlens) -> ``[bounds[-1], np*hn]``: each
        sequence causal over itself. Short sequences (``_batchable``) go through one SDPA call over a right-padded
        ``[b, h, L, hn]`` gather of the pack: a padded key sits after every real query of its sequence, so the
        causal mask already hides it, and padded queries are dropped. Otherwise (long sequences of unequal
        lengths, or attention dropout, whose draws depend on the shapes) one call per sequence. Both are exact
        per sequence; they differ in rounding only (fp32 ~5e-7: the kernel's row reductions run over other
        widths), which is why a layout's rows may differ by that from another layout's."""
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        if _batchable(lengths) and not (self.dropout_p > 0 and self.training):
            gather, keep = _padded_gather(tuple(bounds), query.device)  # [b, L], [sum n] (rows of [b*L])
            q, k, v = (t[gather].transpose(1, 2) for t in (query, key, value))  # [b, h, L, hn]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=self.num_heads != self.num_groups)  # [b, np, L, hn]
            return out.transpose(1, 2).reshape(gather.numel(), -1)[keep]
        outs = [
            self._sdpa(query[s:e, None], key[s:e, None], value[s:e, None], None, causal=True)[:, 0]  # [n, np*hn]
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ]
        return torch.cat(outs, dim=0) if outs else query.new_zeros(0, self.num_heads * query.shape[-1])

    def _thd_cp(self, query, key, value, cu: torch.Tensor, max_seqlen: int | None,
                order: torch.Tensor | None) -> torch.Tensor:
        """CP branch of ``_thd`` (module docstring): local q [T/cp, np, hn], k/v [T/cp, ng, hn], GLOBAL ``cu``
        -> [T/cp, np*hn]. ``order``: the pack's ``cp_global_order`` (``CPLocalPack`` passes it once per
        micro-batch); derived from ``cu`` when a plain ``PackedSeqParams`` comes without it."""
        cp = self.cp_size
        bounds = cu.tolist()
        local_len = query.shape[0]
        if bounds[0] != 0 or bounds[-1] != local_len * cp:
            raise ValueError(
                f"context parallel attention: cu_seqlens ends at {bounds[-1]} but {local_len} local tokens x "
                f"context_parallel_size={cp} = {local_len * cp}; pass the GLOBAL padded cu_seqlens of the pack "
                "split by data.packing.split_for_cp"
            )
        _check_max_seqlen(max_seqlen, bounds)
        groups = key.shape[1]
        kv = all_gather_cp(torch.cat([key, value], dim=1), self.cp_group, grad="reduce")  # [T, 2ng, hn]
        if order is None:
            order = cp_global_order(cp_token_index(cu, cp))
        kv = to_global_order(kv, order.to(kv.device))
        key_all, value_all = kv[:, :groups], kv[:, groups:]  # [T, ng, hn] each, global order
        rank = self.cp_group.rank()
        outs, start = [], 0
        for s, e in zip(bounds[:-1], bounds[1:]):
            chunk = (e - s) // (2 * cp)
            for index in (rank, 2 * cp - 1 - rank):  # the rank's two chunks of this sequence, in local order
                offset = index * chunk  # global position of the chunk's first query within the sequence
                keys = slice(s, s + offset + chunk)  # every key a query of the chunk may see
                outs.append(self._offset_causal(query[start : start + chunk], key_all[keys], value_all[keys], offset))
                start += chunk
        return torch.cat(outs, dim=0)

    def _offset_causal(self, query, key, value, offset: int) -> torch.Tensor:
        """q [c, np, hn] at positions offset..offset+c-1 of a sequence, k/v [offset+c, ng, hn] at positions
        0..offset+c-1 -> [c, np*hn]; query i sees keys 0..offset+i.

        offset 0 is plain causal SDPA. Otherwise, on CPU without dropout: the prefix keys (all visible) and the
        diagonal block (causal) in two mask-free flash calls merged by their log-sum-exp (``_PrefixDiagonal``):
        O(c) memory, where an explicit mask would hold c x (offset + c) entries and be saved for backward.
        Elsewhere (CUDA, dropout): SDPA with the boolean mask ``key_pos <= query_pos`` (exact, O(c * n)
        memory)."""
        if offset == 0:
            return self._sdpa(query[:, None], key[:, None], value[:, None], None, causal=True)[:, 0]
        chunk = query.shape[0]
        if _CPU_FLASH is not None and not query.is_cuda and not (self.dropout_p > 0 and self.training):
            if self.num_heads != self.num_groups:
                key = key.repeat_interleave(self.num_heads // self.num_groups, dim=1)
                value = value.repeat_interleave(self.num_heads // self.num_groups, dim=1)
            q, k, v = (t.permute(1, 0, 2)[None] for t in (query, key, value))  # [1, h, s, hn]
            out = _PrefixDiagonal.apply(q, k[:, :, :offset], v[:, :, :offset], k[:, :, offset:], v[:, :, offset:],
                                        self.softmax_scale)  # fmt: skip
            return out[0].permute(1, 0, 2).reshape(chunk, -1)
        q_pos = torch.arange(offset, offset + chunk, device=query.device)
        mask = torch.arange(offset + chunk, device=query.device)[None, :] <= q_pos[:, None]  # True = attend
        return self._sdpa(query[:, None], key[:, None], value[:, None], mask, causal=False)[:, 0]

    def _use_varlen(self, query: torch.Tensor) -> bool:
        """The flash kernel: CUDA, fp16/bf16, no attention dropout, and a causal form of varlen_attn."""
        return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and not (self.dropout_p > 0 and self.training) and _varlen() is not None)  # fmt: skip

    def _thd_varlen(self, query, key, value, cu: torch.Tensor, max_seqlen: int | None) -> torch.Tensor:
        """The CUDA path of ``_thd``: one flash kernel over all sequences, no host sync when ``max_seqlen`` is
        given. Contract (module docstring): ``cu[-1] == T`` and ``max_seqlen`` >= every sequence; rows the
        kernel does not cover would be left unwritten."""
        if max_seqlen is None:  # a sync; PackedBatch.packed_seq_params() always sets it
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        _check_max_seqlen(max_seqlen, [0] * (cu.numel() - 1) + [query.shape[0]])  # host shapes only (cu[-1] == T)
        varlen = _varlen()
        kwargs = dict(varlen.causal_kwargs)
        if self.num_heads != self.num_groups:
            if varlen.has_gqa:
                kwargs["enable_gqa"] = True
            else:  # expand k/v on the device (a Python repeat count: no sync)
                key = key.repeat_interleave(self.num_heads // self.num_groups, dim=1)
                value = value.repeat_interleave(self.num_heads // self.num_groups, dim=1)
        cu = cu.to(torch.int32)
        out = varlen.fn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=self.softmax_scale, **kwargs)
        return out.reshape(query.shape[0], -1)  # [T, np*hn]

    def _padded(self, query, key, value, attention_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """q [s, b, np, hn], k/v [s, b, ng, hn], mask [b|1, 1, s, s] (True = masked) -> [s, b, np*hn].

        An explicit mask is used as given (it must already contain the causal part, as megatron's does);
        without one, ``causal`` decides."""
        if attention_mask is None:
            return self._sdpa(query, key, value, None, causal=causal)
        mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        mask = mask.masked_fill(attention_mask.bool(), torch.finfo(query.dtype).min)
        return self._sdpa(query, key, value, mask, causal=False)

    def _sdpa(self, query, key, value, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """[s, b, h, hn] inputs -> [s, b, np*hn] (``mask``: additive float or boolean True = attend; or
        ``causal``)."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, hn]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_groups,
        )  # [b, np, s, hn]
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _dropout_rng(self) -> contextlib.AbstractContextManager:
        """Dropout draws from the model-parallel RNG stream unless sequence parallel (as megatron does)."""
        if self.dropout_p > 0 and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


class _PrefixDiagonal(torch.autograd.Function):
    """Attention of queries [1, h, c, hn] over prefix keys (all visible) and a diagonal block (causal), exactly
    as one softmax over both: two flash calls whose outputs are merged by their log-sum-exps, and whose
    backward passes run with the MERGED output and log-sum-exp (so each block's gradient is that of the joint
    softmax; the blockwise form of ring attention). CPU flash kernel (``_CPU_FLASH``), no dropout."""

    @staticmethod
    def forward(ctx, q, k_pre, v_pre, k_diag, v_diag, scale: float):
        fwd = _CPU_FLASH[0]
        out_pre, lse_pre = fwd(q, k_pre, v_pre, 0.0, False, scale=scale)
        out_diag, lse_diag = fwd(q, k_diag, v_diag, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_pre, lse_diag)  # [1, h, c]
        out = (lse_pre - lse).exp().unsqueeze(-1) * out_pre + (lse_diag - lse).exp().unsqueeze(-1) * out_diag
        ctx.save_for_backward(q, k_pre, v_pre, k_diag, v_diag, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_pre, v_pre, k_diag, v_diag, out, lse = ctx.saved_tensors
        bwd, grad = _CPU_FLASH[1], grad.contiguous()
        dq_pre, dk_pre, dv_pre = bwd(grad, q, k_pre, v_pre, out, lse, 0.0, False, scale=ctx.scale)
        dq_diag, dk_diag, dv_diag = bwd(grad, q, k_diag, v_diag, out, lse, 0.0, True, scale=ctx.scale)
        return dq_pre + dq_diag, dk_pre, dv_pre, dk_diag, dv_diag, None


def _find_cpu_flash():
    """torch's CPU flash-attention op pair (output and log-sum-exp; its backward), or None (then the masked
    SDPA path). Private torch ops: Workaround W16 in docs/MEGATRON_CORE.md."""
    try:
        ops = torch.ops.aten
        return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):
        return None


_CPU_FLASH = _find_cpu_flash()


class _VarlenAttn:
    """``torch.nn.attention.varlen.varlen_attn`` and the keyword arguments its installed version takes.

    Causal is ``window_size=(-1, 0)`` in torch 2.11-2.13 (no ``is_causal``); ``enable_gqa`` exists in 2.13 but
    not necessarily in older versions (then k/v are expanded). Checked once, with ``inspect``."""

    def __init__(self, fn):
        params = inspect.signature(fn).parameters
        self.fn = fn
        self.has_gqa = "enable_gqa" in params
        if "is_causal" in params:
            self.causal_kwargs = {"is_causal": True}
        elif "window_size" in params:
            self.causal_kwargs = {"window_size": (-1, 0)}
        else:
            raise TypeError("varlen_attn takes neither is_causal nor window_size")
        if "scale" not in params:
            raise TypeError("varlen_attn takes no scale")


def _find_varlen() -> _VarlenAttn | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: the exact per-sequence path everywhere
        return None
    try:
        return _VarlenAttn(varlen_attn)
    except TypeError as err:
        logger.warning("torch.nn.attention.varlen.varlen_attn not usable (%s); THD attention loops over sequences",
                       err)
        return None


_UNKNOWN = object()
_VARLEN: Any = _UNKNOWN
"""``_find_varlen()``, looked up at the first CUDA call (``_varlen``): importing ``torch.nn.attention.varlen``
imports TorchDynamo (~2.5 CPU s), which a CPU run never needs."""


def _varlen() -> _VarlenAttn | None:
    global _VARLEN
    if _VARLEN is _UNKNOWN:
        _VARLEN = _find_varlen()
    return _VARLEN


BATCH_PADDED_LEN = 256
"""``packed_causal`` pads a pack's sequences to its longest when that is at most this many tokens, or when the
padded work ``b * L**2`` is at most twice the exact ``sum n**2``: one attention call instead of one per sequence
(the tiny GRPO step: 64 sequences of 12-36 tokens, a layer's forward and backward 23 -> 7 ms on one CPU core)."""


def _batchable(lengths: list[int]) -> bool:
    longest = max(lengths, default=0)
    if len(lengths) < 2 or longest == 0:
        return False
    return longest <= BATCH_PADDED_LEN or len(lengths) * longest**2 <= 2 * sum(n * n for n in lengths)


@functools.lru_cache(maxsize=16)
def _padded_gather(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For host ``bounds``: ``gather [b, L]`` (token index of each sequence's position, its first token at a
    padded position) and ``keep`` (the rows of the flattened ``[b*L]`` that are real, in pack order). Cached: every
    layer of a forward (and the next forward of a decoding prefill) asks for the same."""
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    position = torch.arange(int(lengths.max()))
    real = position[None, :] < lengths[:, None]
    pad = starts.clamp(max=max(bounds[-1] - 1, 0))[:, None]  # any real token (an empty last sequence: the one before)
    gather = torch.where(real, starts[:, None] + position[None, :], pad)
    keep = real.reshape(-1).nonzero()[:, 0]
    return gather.to(device), keep.to(device)


def _check_supported(config: TransformerConfig) -> None:
    if config.window_size is not None:
        raise ValueError(f"window_size={config.window_size} is not supported by the local attention; unset it")
    if config.softmax_type != "vanilla":
        raise ValueError(f"softmax_type={config.softmax_type!r} is not supported; use 'vanilla'")


def _check_max_seqlen(max_seqlen: int | None, bounds: list[int]) -> None:
    """max_seqlen equal to the whole pack makes megatron's THD RoPE continue positions across sequences
    (``rope_utils.py:211`` takes its "offsets" branch): the output is silently wrong, so refuse it."""
    if max_seqlen is not None and len(bounds) > 2 and max_seqlen == bounds[-1]:
        raise ValueError(
            f"PackedSeqParams.max_seqlen_q={max_seqlen} equals the whole packed length with {len(bounds) - 1} "
            "sequences; set it to the longest single sequence (PackedBatch.max_seqlen does)"
        )
