"""model/rotary.py: per-token packed RoPE == megatron-core's THD RoPE, bitwise, without megatron's per-layer syncs.

Reference: the same model (same weights) fed a plain ``PackedSeqParams``, for which ``PackedRopeSelfAttention``
leaves megatron-core's own THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``) in charge. The claim is bitwise
equality (the module docstring argues why: same operations on same-shaped tensors), so the tolerance is 0.
"""

import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.data.packing import pack
from megatron_rl.model import rotary
from megatron_rl.model.builder import build_gpt_model

MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128, qk_layernorm=True, attention_backend="local")
LENGTHS = [7, 1, 12, 3, 9]


def _pack(align, seed=0, width=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL.vocab_size, (len(LENGTHS), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, width - n:] = 1
    return pack(ids, mask, align=align)


def _megatron_params(packed) -> PackedSeqParams:
    """The same pack as a plain PackedSeqParams: megatron-core's THD RoPE runs."""
    ours = packed.packed_seq_params()
    return PackedSeqParams(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(PackedSeqParams)})


def _logits(model, packed, params, grad=False):
    device = next(model.parameters()).device
    packed = packed.to(device)
    with torch.set_grad_enabled(grad):
        return model(packed.input_ids, packed.position_ids, None, packed_seq_params=params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("align", [1, 4])
def test_per_token_rope_is_bitwise_megatron_thd_rope(groups, dtype, align):
    model = build_gpt_model(dataclasses.replace(MODEL, params_dtype=dtype), ParallelConfig(), groups).eval()
    packed = _pack(align)
    ours = _logits(model, packed, packed.to(groups.device).packed_seq_params())
    reference = _logits(model, packed, _megatron_params(packed.to(groups.device)))
    assert isinstance(packed.packed_seq_params(), rotary.PackedRopeParams)
    assert torch.equal(ours, reference)


def test_gradients_are_bitwise_megatron_and_no_thd_rope_runs(groups, monkeypatch):
    """Training path: gradients equal too; and megatron's THD RoPE (the host-syncing one) is not called."""
    model = build_gpt_model(MODEL, ParallelConfig(), groups).train()
    packed = _pack(align=2, seed=1)

    def grads(params):
        model.zero_grad()
        _logits(model, packed, params, grad=True).float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads(_megatron_params(packed.to(groups.device)))

    def refuse(*args, **kwargs):
        raise AssertionError("megatron-core's THD RoPE ran (host syncs per layer)")

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", refuse)
    ours = grads(packed.to(groups.device).packed_seq_params())
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[n], reference[n]) for n in ours)


def test_cos_sin_computed_once_per_micro_batch(groups, monkeypatch):
    model = build_gpt_model(MODEL, ParallelConfig(), groups).eval()
    packed = _pack(align=1).to(groups.device)
    params = packed.packed_seq_params()
    calls = []
    real_cos = torch.cos
    monkeypatch.setattr(rotary.torch, "cos", lambda x: calls.append(x.shape) or real_cos(x))
    _logits(model, packed, params)
    assert len(calls) == 1 and len(params.rope_cache) == 1  # one table gather for MODEL.num_layers == 2 layers


def test_positions_matter(groups):
    """A planted bug (every position 0, i.e. no rotation) changes the logits: the tests above would catch it."""
    model = build_gpt_model(MODEL, ParallelConfig(), groups).eval()
    packed = _pack(align=1).to(groups.device)
    params = packed.packed_seq_params()
    shifted = dataclasses.replace(params, position_ids=params.position_ids * 0, rope_cache={})
    assert not torch.equal(_logits(model, packed, params), _logits(model, packed, shifted))
