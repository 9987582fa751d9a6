"""PackedDotProductAttention's kernels and RMSNorm's by device, and the attention-backend choice.

CPU: the exact SDPA path stays the CPU path (one padded call over short sequences, else one call per sequence,
both against plain per-sequence calls); the CUDA (varlen) plumbing - causal keyword, GQA
native or by expanding k/v, int32 cu_seqlens, output layout - is checked on CPU by standing in a loop
reference for ``varlen_attn``. GPU (``gpu`` marker, skipped without CUDA): the flash kernel itself against
the per-sequence path, and ``F.rms_norm`` against the elementwise chain, in bf16.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.distributed.bootstrap import initialize_distributed
from megatron_rl.model import attention as attention_module
from megatron_rl.model.builder import build_transformer_config, use_transformer_engine
from megatron_rl.model.norm import RMSNorm

HEADS, GROUPS, HEAD_DIM = 4, 2, 16
LENGTHS = [5, 1, 9, 3]
BF16_TOL = 2e-2
"""bf16 flash vs per-sequence SDPA: both round q k^T, softmax and p v to bf16 in different orders; O(1) inputs
give differences of a few bf16 ulps of O(1) outputs (2**-8 = 4e-3 each; GPU_NOTES measured 0.004-0.008 at
head dim 128); a cross-sequence leak or a wrong causal mask moves outputs by O(0.1)."""


GROUPS_SEED = 1  # the ``groups`` fixture's (tests/conftest.py)


def _attention(groups, dtype=torch.float32):
    cfg = ModelConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
                      ffn_hidden_size=32)  # fmt: skip
    cfg = dataclasses.replace(cfg, params_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    config = build_transformer_config(cfg, ParallelConfig())
    from megatron.core.transformer.enums import AttnMaskType

    return attention_module.PackedDotProductAttention(config, 1, AttnMaskType.causal, "self",
                                                      pg_collection=groups.pg_collection)  # fmt: skip


def _params(device="cpu"):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                           max_seqlen_kv=max(LENGTHS))  # fmt: skip


def _qkv(dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, GROUPS, HEAD_DIM, generator=gen) for _ in range(2))
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _loop_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size=(-1, -1), enable_gqa=False):
    """Stand-in for varlen_attn with its documented semantics (a loop over sequences; checks the call)."""
    assert cu_q.dtype == torch.int32 and window_size == (-1, 0)
    assert enable_gqa or k.shape[1] == q.shape[1], "k/v must be expanded when enable_gqa is missing"
    bounds = cu_q.tolist()
    assert max_q == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    outs = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    return torch.cat(outs)  # [T, H, D]


def test_cpu_keeps_the_per_sequence_path(groups):
    attn = _attention(groups)
    assert not attn._use_varlen(torch.zeros(1, HEADS, HEAD_DIM))
    if attention_module._varlen() is not None:  # torch >= 2.10: the signature was understood
        assert attention_module._varlen().causal_kwargs in ({"window_size": (-1, 0)}, {"is_causal": True})


@pytest.mark.parametrize("has_gqa", [True, False])
def test_varlen_plumbing_matches_per_sequence_path(groups, monkeypatch, has_gqa):
    attn = _attention(groups)
    fake = attention_module._VarlenAttn(_loop_varlen)
    fake.has_gqa = has_gqa
    monkeypatch.setattr(attention_module, "_VARLEN", fake)
    q, k, v = _qkv()
    reference = attn(q, k, v, None, packed_seq_params=_params())
    monkeypatch.setattr(attn, "_use_varlen", lambda query: True)
    fast = attn(q, k, v, None, packed_seq_params=_params())
    assert fast.shape == reference.shape == (sum(LENGTHS), HEADS * HEAD_DIM)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-6)  # fp32, same math in another grouping


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [4, 0, 7, 7, 2], [300, 10, 10]])
def test_packed_causal_matches_per_sequence_calls(groups, lengths):
    """The padded one-call path (short sequences, an empty one) and the per-sequence path (long unequal
    sequences: padding would more than double the work) give each sequence its own causal attention: outputs
    and gradients against one plain SDPA call per sequence, fp32 (the padded call differs by rounding only:
    its kernel's row reductions run over the padded width, ~5e-7 at these sizes; a key of another sequence or
    a padded key seen moves outputs by O(0.1)). Rows after the last sequence are 0."""
    attn = _attention(groups)
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths) + 3  # + an unused tail (align padding)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(total, GROUPS, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))  # fmt: skip
    out = attn(q, k, v, None, packed_seq_params=params)
    reference = torch.cat([_loop_varlen(q, k, v, cu, cu, max(lengths), max(lengths), scale=attn.softmax_scale,
                                        window_size=(-1, 0), enable_gqa=True).reshape(sum(lengths), -1),
                           torch.zeros(3, HEADS * HEAD_DIM)])  # fmt: skip
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-6)
    grad = torch.randn(out.shape, generator=gen)
    for mine, ref in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, rtol=0, atol=2e-6)
    assert attention_module._batchable(lengths) == (max(lengths) <= attention_module.BATCH_PADDED_LEN)


def test_varlen_signature_errors_are_clear():
    with pytest.raises(TypeError, match="is_causal nor window_size"):
        attention_module._VarlenAttn(lambda q, k, v, cu_q, cu_k, max_q, max_k, scale=None: q)


def test_auto_backend_never_picks_transformer_engine(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # "TE installed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not use_transformer_engine(ModelConfig(attention_backend="auto"))
    assert not use_transformer_engine(ModelConfig(attention_backend="local"))
    assert use_transformer_engine(ModelConfig(attention_backend="te"))


def test_te_backend_without_te_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="attention_backend='te' needs TransformerEngine"):
        use_transformer_engine(ModelConfig(attention_backend="te"))


def _chain_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_cpu_rms_norm_is_the_elementwise_chain(groups):
    config = build_transformer_config(ModelConfig(), ParallelConfig())
    norm = RMSNorm(config, 64, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(7, 64)
    assert torch.equal(norm(x), _chain_rms_norm(x, norm.weight, 1e-6))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_flash_varlen_matches_per_sequence_path_bf16(groups):
    if attention_module._varlen() is None:
        pytest.skip("torch has no usable varlen_attn")
    attn = _attention(groups, torch.bfloat16).cuda()
    q, k, v = _qkv(torch.bfloat16, "cuda")
    assert attn._use_varlen(q)
    fast = attn(q, k, v, None, packed_seq_params=_params("cuda"))
    grads_fast = torch.autograd.grad(fast.float().square().sum(), (q, k, v))
    attn._use_varlen = lambda query: False
    slow = attn(q, k, v, None, packed_seq_params=_params("cuda"))
    grads_slow = torch.autograd.grad(slow.float().square().sum(), (q, k, v))
    torch.testing.assert_close(fast.float(), slow.float(), rtol=0, atol=BF16_TOL)
    for a, b in zip(grads_fast, grads_slow):  # gradients of an O(T) sum: compare relative to their scale
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2 * BF16_TOL * max(1.0, scale)


@pytest.mark.gpu
@cuda
def test_cuda_rms_norm_matches_chain_bf16(groups):
    config = build_transformer_config(ModelConfig(params_dtype="bfloat16"), ParallelConfig())
    norm = RMSNorm(config, 256, eps=1e-6).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    # both normalize in fp32 and round once to bf16 before the scale: at most 1 bf16 ulp apart (2**-8 relative)
    torch.testing.assert_close(norm(x).float(), _chain_rms_norm(x, norm.weight, 1e-6).float(),
                               rtol=2**-7, atol=1e-6)  # fmt: skip


# ---------------------------------------------------------------------- context parallelism (2 gloo ranks)

CP_LENGTHS = [8, 4, 12, 4]  # padded to multiples of 2*cp = 4: chunks of 2, 1, 3, 1 tokens


def _cp_inputs():
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(3)
    total = sum(CP_LENGTHS)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, GROUPS, HEAD_DIM, generator=gen) for _ in range(2))
    weight = torch.randn(total, HEADS * HEAD_DIM, generator=gen)  # loss = sum(out * weight)
    cu = torch.tensor([0] + torch.tensor(CP_LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(CP_LENGTHS),
                             max_seqlen_kv=max(CP_LENGTHS))  # fmt: skip
    return q, k, v, weight, params


def _cp_attention_rank(rank, world_size, cpu_flash: bool):
    """CP rank ``rank`` of 2: its chunks of q/k/v -> output and q/k/v gradients of its part of the loss.
    ``cpu_flash=False``: the masked-SDPA path (CUDA's) instead of the log-sum-exp merge of two flash calls."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.data.packing import cp_token_index

    parallel = ParallelConfig(context_parallel_size=2)
    groups = initialize_distributed(parallel, seed=1)
    if not cpu_flash:
        attention_module._CPU_FLASH = None
    cfg = ModelConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
                      ffn_hidden_size=32)  # fmt: skip
    attn = attention_module.PackedDotProductAttention(build_transformer_config(cfg, parallel), 1, AttnMaskType.causal,
                                                      "self", pg_collection=groups.pg_collection)  # fmt: skip
    q, k, v, weight, params = _cp_inputs()
    mine = cp_token_index(params.cu_seqlens_q, 2)[groups.cp_rank]
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = attn(*local, None, packed_seq_params=params)
    (out * weight[mine]).sum().backward()
    return {"index": mine, "out": out.detach(), "grads": [t.grad for t in local]}


@pytest.mark.multirank
@pytest.mark.parametrize("cpu_flash", [True, False])
def test_cp_attention_matches_single_process(groups, cpu_flash):
    """CP2 attention (K/V all-gather, causal by global position) == the single-process packed attention, for
    the outputs and for the q/k/v gradients (the K/V gather's backward sums the ranks' contributions)."""
    from tests.support.multirank import run_ranks

    q, k, v, weight, params = _cp_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    reference = _attention(groups)(q, k, v, None, packed_seq_params=params)
    (reference * weight).sum().backward()
    for res in run_ranks(2, _cp_attention_rank, cpu_flash, timeout=180):
        idx = res["index"]
        torch.testing.assert_close(res["out"], reference.detach()[idx], rtol=0, atol=1e-6)
        for got, full in zip(res["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, full[idx], rtol=0, atol=1e-5)
