"""The MoE auxiliary losses of model/moe.py against megatron-core's own loss functions, one sequence at a time.

Reference: megatron-core's ``switch_load_balancing_loss_func`` / ``z_loss_func`` / ``compute_routing_scores_for_aux_loss``
applied to each sequence's tokens alone (no packing, no padding). Tolerance 1e-6 relative: the same fp32
arithmetic summed in a different order.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.model import moe

E, K = 6, 2
SEQ_LENS = [5, 3, 7]
ALIGN = 4  # packs pad each sequence to a multiple of 4, plus a dummy tail of 4


def _pack():
    padded = [-(-n // ALIGN) * ALIGN for n in SEQ_LENS]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist(), sum(padded) + ALIGN], dtype=torch.int32)
    total = int(cu[-1])
    logits = torch.randn(total, E, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    return cu, total, logits


def _tokens(cu, total, num_seqs=len(SEQ_LENS), num_tokens=sum(SEQ_LENS)):
    return moe.MoETokens(segment_ids=moe.segment_ids(cu, torch.tensor(SEQ_LENS), total),
                         seq_lens=torch.tensor(SEQ_LENS, dtype=torch.float32), inv_num_seqs=1.0 / num_seqs,
                         inv_num_tokens=1.0 / num_tokens, grad_scale=1.0)


def test_segment_ids_mark_padding_and_the_dummy_tail():
    cu, total, _ = _pack()
    seg = moe.segment_ids(cu, torch.tensor(SEQ_LENS), total)
    expected = [0] * 5 + [-1] * 3 + [1] * 3 + [-1] + [2] * 7 + [-1] + [-1] * 4
    assert seg.tolist() == expected


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_is_the_mean_of_megatron_per_sequence_losses(score_function):
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func,
    )

    cu, total, logits = _pack()
    spec = moe._LossSpec(aux_coeff=0.3, z_coeff=0.0)
    got = moe._aux_and_z_loss(logits, _tokens(cu, total), spec, K, score_function)
    per_seq = []
    for i, n in enumerate(SEQ_LENS):
        seq_logits = logits[int(cu[i]): int(cu[i]) + n]
        routing_map, scores = compute_routing_scores_for_aux_loss(seq_logits, K, score_function)
        per_seq.append(switch_load_balancing_loss_func(scores, routing_map.sum(0), n, K, E, 0.3))
    want = torch.stack(per_seq).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_z_loss_is_the_token_mean_of_megatron_z_loss():
    from megatron.core.transformer.moe.moe_utils import z_loss_func

    cu, total, logits = _pack()
    got = moe._aux_and_z_loss(logits, _tokens(cu, total), moe._LossSpec(aux_coeff=0.0, z_coeff=0.02), K, "softmax")
    valid = torch.cat([logits[int(cu[i]): int(cu[i]) + n] for i, n in enumerate(SEQ_LENS)])
    assert float(got) == pytest.approx(float(z_loss_func(valid, 0.02)), rel=1e-6)


def test_losses_decompose_over_sequences():
    """A pack's loss is the sum of its sequences' losses computed alone (same normalizers): packing and
    micro-batching cannot change the objective."""
    cu, total, logits = _pack()
    spec = moe._LossSpec(aux_coeff=0.3, z_coeff=0.02)
    whole = moe._aux_and_z_loss(logits, _tokens(cu, total), spec, K, "softmax")
    parts = 0.0
    for i, n in enumerate(SEQ_LENS):
        alone = logits[int(cu[i]): int(cu[i]) + n]
        tokens = moe.MoETokens(segment_ids=torch.zeros(n, dtype=torch.long), seq_lens=torch.tensor([float(n)]),
                               inv_num_seqs=1.0 / len(SEQ_LENS), inv_num_tokens=1.0 / sum(SEQ_LENS), grad_scale=1.0)
        parts = parts + moe._aux_and_z_loss(alone, tokens, spec, K, "softmax")
    assert float(whole) == pytest.approx(float(parts), rel=1e-6)


def test_injected_gradient_is_the_loss_gradient_times_the_scale():
    logits = torch.randn(8, E, requires_grad=True)
    probs = torch.softmax(logits, -1)
    loss = (logits ** 2).sum()
    out = moe._AddLossGradient.apply(probs, loss, 3.0)
    out.sum().backward()
    check = logits.detach().clone().requires_grad_(True)
    (torch.softmax(check, -1).sum() + 3.0 * (check ** 2).sum()).backward()
    assert torch.allclose(logits.grad, check.grad, atol=1e-6)
