"""The chunked log-prob/entropy head against the unchunked head it replaced (bitwise on CPU) and plain torch.

``_UnchunkedReference`` is the previous implementation of ``vocab_parallel_logprobs_entropy``, kept here
verbatim as the reference: the chunked head must give the same bits (values and gradients; fp32 and bf16
inputs; TP1 and TP2; with and without entropy and vocabulary padding). ``CHUNK_BYTES`` is lowered so that
the small test shapes run through several chunks, including a ragged last one.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.model import logprobs as head
from tests.support.multirank import run_ranks


def _group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(tensor, op, group):
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _masked_fp32(logits, vocab_start, valid_vocab_size):
    x = logits.float()
    if valid_vocab_size is None or vocab_start + x.shape[-1] <= valid_vocab_size:
        return x
    columns = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
    return x.masked_fill(columns >= valid_vocab_size, torch.finfo(torch.float32).min)


class _UnchunkedReference(torch.autograd.Function):
    """The head before chunking (it saved fp32 ``p`` and ``x - m`` of every row for the backward)."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, compute_entropy, valid_vocab_size):
        vocab_local = logits.shape[-1]
        tp_rank = 0 if _group_size(tp_group) == 1 else dist.get_rank(tp_group)
        x = _masked_fp32(logits, tp_rank * vocab_local, valid_vocab_size)
        m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)
        shifted = x - m.unsqueeze(-1)
        exp = shifted.exp()
        log_z = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group).log()
        local_label = labels - tp_rank * vocab_local
        in_shard = (local_label >= 0) & (local_label < vocab_local)
        picked = shifted.gather(-1, local_label.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, tp_group)
        logprobs = picked - log_z
        probs = exp.div_(log_z.exp().unsqueeze(-1))
        mean_shifted = None
        entropy = logprobs.new_zeros(())
        if compute_entropy:
            mean_shifted = _all_reduce((probs * shifted).sum(dim=-1), dist.ReduceOp.SUM, tp_group)
            entropy = log_z - mean_shifted
        ctx.save_for_backward(probs, shifted if compute_entropy else None, mean_shifted, local_label, in_shard)
        ctx.input_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        probs, shifted, mean_shifted, local_label, in_shard = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_logprobs is not None:
            grad -= probs * grad_logprobs.unsqueeze(-1)
            onehot_grad = torch.where(in_shard, grad_logprobs, 0.0).unsqueeze(-1)
            grad.scatter_add_(-1, local_label.clamp(0, probs.shape[-1] - 1).unsqueeze(-1), onehot_grad)
        if grad_entropy is not None and shifted is not None:
            grad -= probs * (shifted - mean_shifted.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None


def _run(fn, logits, labels, group, compute_entropy, valid, w_lp, w_ent):
    """``(logprobs, entropy or None, d(sum(w_lp*lp + w_ent*H))/d logits)``; a weight None = not in the loss."""
    leaf = logits.detach().clone().requires_grad_()
    lp, ent = fn(leaf, labels, group, compute_entropy, valid)
    loss = 0.0
    if w_lp is not None:
        loss = loss + (w_lp * lp).sum()
    if w_ent is not None and compute_entropy:
        loss = loss + (w_ent * ent).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if compute_entropy else None), leaf.grad


def _ours(logits, labels, group, compute_entropy, valid):
    return head.vocab_parallel_logprobs_entropy(logits, labels, group, compute_entropy, valid_vocab_size=valid)


def _reference(logits, labels, group, compute_entropy, valid):
    return _UnchunkedReference.apply(logits, labels, group, compute_entropy, valid)


def _inputs(shape, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(*shape, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    return logits, labels, torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def _assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), (x - y).abs().max()


CASES = [  # (dtype, compute_entropy, valid_vocab_size, loss weights)
    (torch.float32, True, None, "both"),
    (torch.float32, False, None, "lp"),
    (torch.float32, True, 61, "both"),
    (torch.float32, True, None, "ent"),
    (torch.bfloat16, True, 61, "both"),
    (torch.bfloat16, False, None, "lp"),
]


def _weights(which, w_lp, w_ent):
    return (w_lp if which in ("both", "lp") else None), (w_ent if which in ("both", "ent") else None)


@pytest.mark.parametrize("dtype, compute_entropy, valid, which", CASES)
def test_chunked_head_is_bitwise_the_unchunked_head_tp1(monkeypatch, dtype, compute_entropy, valid, which):
    vocab = 64
    monkeypatch.setattr(head, "CHUNK_BYTES", 4 * vocab * 5)  # 5 rows per chunk: 37 rows = 7 full + 1 ragged
    logits, labels, w_lp, w_ent = _inputs((1, 37), vocab, dtype)
    w_lp, w_ent = _weights(which, w_lp, w_ent)
    ours = _run(_ours, logits, labels, None, compute_entropy, valid, w_lp, w_ent)
    ref = _run(_reference, logits, labels, None, compute_entropy, valid, w_lp, w_ent)
    _assert_bitwise(ours, ref)


def test_chunked_head_matches_plain_torch_log_softmax(monkeypatch):
    vocab = 50
    monkeypatch.setattr(head, "CHUNK_BYTES", 4 * vocab * 3)
    logits, labels, w_lp, w_ent = _inputs((4, 5), vocab, torch.float32, seed=1)
    lp, ent, grad = _run(_ours, logits, labels, None, True, None, w_lp, w_ent)
    leaf = logits.clone().requires_grad_()
    log_p = torch.log_softmax(leaf, dim=-1)
    ref_lp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (w_lp * ref_lp + w_ent * ref_ent).sum().backward()
    # fp32, O(1) values: the two computations differ by a few ulps of log Z (~1e-7 relative)
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=1e-6)


def test_non_contiguous_logits_and_empty_rows(monkeypatch):
    monkeypatch.setattr(head, "CHUNK_BYTES", 4 * 16 * 2)
    logits, labels, w_lp, w_ent = _inputs((3, 5), 16, torch.float32, seed=2)
    logits_t, labels_t = logits.transpose(0, 1), labels.t()  # [5, 3, V], not contiguous
    w_lp, w_ent = w_lp.t(), w_ent.t()
    _assert_bitwise(_run(_ours, logits_t, labels_t, None, True, None, w_lp, w_ent),
                    _run(_reference, logits_t, labels_t, None, True, None, w_lp, w_ent))  # fmt: skip
    lp, ent = head.vocab_parallel_logprobs_entropy(torch.zeros(1, 0, 16), torch.zeros(1, 0, dtype=torch.long),
                                                   None, True)  # fmt: skip
    assert lp.shape == (1, 0) and ent.shape == (1, 0)


def _tp2_rank(rank, world_size, logits, labels, w_lp, w_ent, cases):
    dist.init_process_group("gloo")
    head.CHUNK_BYTES = 4 * (logits.shape[-1] // world_size) * 4  # 4 rows per chunk
    out = []
    for dtype, compute_entropy, valid, which in cases:
        shard = logits.to(dtype).chunk(world_size, dim=-1)[rank]
        wl, we = _weights(which, w_lp, w_ent)
        args = (shard, labels, dist.group.WORLD, compute_entropy, valid, wl, we)
        out.append((_run(_ours, *args), _run(_reference, *args)))
    return out


@pytest.mark.multirank
def test_chunked_head_is_bitwise_the_unchunked_head_tp2():
    logits, labels, w_lp, w_ent = _inputs((2, 9), 64, torch.float32, seed=3)
    for ours, ref in (pair for rank in run_ranks(2, _tp2_rank, logits, labels, w_lp, w_ent, CASES) for pair in rank):
        _assert_bitwise(ours, ref)
