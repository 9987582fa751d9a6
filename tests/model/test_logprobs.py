"""vocab_parallel_logprobs_entropy against a plain-torch full-vocab reference (log_softmax), TP1 and TP2."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
from tests.support.multirank import run_ranks

VOCAB = 12


def _reference(logits: torch.Tensor, labels: torch.Tensor, w_lp: torch.Tensor, w_ent: torch.Tensor):
    """Values and d(sum(w_lp*logp + w_ent*H))/d logits from torch.log_softmax over the full vocab."""
    logits = logits.detach().clone().requires_grad_()
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (w_lp * logprobs + w_ent * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), logits.grad


def _inputs(seed: int = 0, shape=(3, 7)):
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(*shape, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    return logits, labels, torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def _ours(logits, labels, w_lp, w_ent, group, compute_entropy=True):
    """Our values and gradient for the same weighted sum; also whether the input was left untouched."""
    leaf = logits.detach().clone().requires_grad_()
    before = leaf.detach().clone()
    logprobs, entropy = vocab_parallel_logprobs_entropy(leaf, labels, group, compute_entropy)
    loss = (w_lp * logprobs).sum() + ((w_ent * entropy).sum() if compute_entropy else 0.0)
    loss.backward()
    return logprobs.detach(), entropy, leaf.grad, torch.equal(leaf.detach(), before)


def test_tp1_values_gradients_and_input_untouched():
    logits, labels, w_lp, w_ent = _inputs()
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, w_lp, w_ent)
    lp, ent, grad, untouched = _ours(logits, labels, w_lp, w_ent, None)
    assert untouched
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


def test_tp1_logprobs_only_gradient_and_entropy_none():
    logits, labels, w_lp, _ = _inputs(seed=1)
    _, _, ref_grad = _reference(logits, labels, w_lp, torch.zeros_like(w_lp))
    lp, ent, grad, _ = _ours(logits, labels, w_lp, None, None, compute_entropy=False)
    assert ent is None
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


def test_valid_vocab_size_excludes_padding_columns():
    logits, labels, w_lp, w_ent = _inputs(seed=2)
    labels = labels.clamp(max=VOCAB - 3)
    ref_lp, ref_ent, ref_grad = _reference(logits[..., : VOCAB - 2], labels, w_lp, w_ent)
    leaf = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(leaf, labels, None, True, valid_vocab_size=VOCAB - 2)
    (w_lp * lp + w_ent * ent).sum().backward()
    torch.testing.assert_close(lp.detach(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(leaf.grad[..., : VOCAB - 2], ref_grad, rtol=0, atol=1e-6)
    assert torch.all(leaf.grad[..., VOCAB - 2 :] == 0)


def test_bf16_logits_give_fp32_results_and_bf16_grad():
    logits, labels, w_lp, w_ent = _inputs(seed=3)
    logits = logits.bfloat16()
    ref_lp, ref_ent, _ = _reference(logits.float(), labels, w_lp, w_ent)
    lp, ent, grad, untouched = _ours(logits, labels, w_lp, w_ent, None)
    assert untouched and lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # fp32 math on the bf16 values


def _tp2_shard(rank: int, world_size: int, logits, labels, w_lp, w_ent) -> dict:
    dist.init_process_group("gloo")
    shard = logits.chunk(world_size, dim=-1)[rank]
    lp, ent, grad, untouched = _ours(shard, labels, w_lp, w_ent, dist.group.WORLD)
    return {"lp": lp, "ent": ent.detach(), "grad": grad, "untouched": untouched}


@pytest.mark.multirank
def test_tp2_matches_full_vocab_reference():
    logits, labels, w_lp, w_ent = _inputs(seed=4, shape=(2, 9))
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, w_lp, w_ent)
    out = run_ranks(2, _tp2_shard, logits, labels, w_lp, w_ent)
    for o in out:
        assert o["untouched"]
        torch.testing.assert_close(o["lp"], ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(o["ent"], ref_ent, rtol=0, atol=1e-5)
    grad = torch.cat([o["grad"] for o in out], dim=-1)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
