"""Per-token log-probabilities and entropy from vocab-sharded logits (docs/DESIGN.md section 4).

Place in the data flow: right after the model's last pipeline stage, before the loss. Logits arrive
vocab-sharded over the tensor-parallel group: TP rank r holds columns ``[r*V_l, (r+1)*V_l)`` of the vocab.

    m      = max over the full vocab         (local max, all-reduce MAX)
    Z      = sum_j exp(x_j - m)              (local sum, all-reduce SUM)
    log p(label) = (x_label - m) - log Z     (x_label lives on one rank: masked gather, all-reduce SUM)
    H      = log Z - sum_j p_j (x_j - m)     (local sum, all-reduce SUM)

All in fp32; the full vocab is never gathered; the input logits are never written to (unlike megatron's
``vocab_parallel_cross_entropy``, which overwrites fp32 inputs with the softmax). The backward is local:

    d logp / d x_j = 1[j == label] - p_j          d H / d x_j = -p_j (x_j - sum_k p_k x_k)

Memory: the head works on row chunks of ``CHUNK_BYTES`` per fp32 temporary and saves only the input logits
(their own dtype: bf16 in bf16 training) plus ``m``, ``log Z`` and ``E_p[x - m]`` (``[N]`` fp32 each); the
backward recomputes ``p`` chunk by chunk. No fp32 ``[N, V_l]`` tensor lives between forward and backward
(the unchunked version kept ``p`` and, with entropy, ``x - m``: 2 x 5 GB at N = 8,192, V = 151,936). Every
formula is applied row by row exactly as written above, so the values and gradients are those of the
unchunked computation (``tests/model/test_logprob_head.py`` checks bitwise equality on CPU). The all-reduces
run once per pass over all rows, not once per chunk.

``vocab_parallel_kl`` is the full-vocabulary KL between two vocab-sharded distributions (on-policy distillation's
``full_kl``, distillation/full_kl.py), with the same reductions and chunking:

    KL(p || q) = sum_j p_j (log p_j - log q_j)     (both log-softmaxes as above; one all-reduce SUM)
    d KL / d x_j = p_j ((log p_j - log q_j) - KL)  (local; no gradient for q's logits)

``vocab_parallel_log_softmax`` returns the whole row ``(x - m) - log Z`` (all-gathered over TP), for the few
positions where a sampler needs the full distribution.

Labels outside ``[0, V)`` (e.g. a masked position's filler) give a meaningless value and no error: mask them
afterwards. ``valid_vocab_size`` excludes vocabulary padding columns (see ``model.builder.padded_vocab_size``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

CHUNK_BYTES = 1 << 28
"""Target size of one fp32 ``[rows, V_l]`` temporary of the chunked head (256 MiB: ~440 rows at V = 151,936)."""


def _group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _masked_fp32(logits: torch.Tensor, vocab_start: int, valid_vocab_size: int | None) -> torch.Tensor:
    """fp32 view/copy of the local shard; padding columns >= valid_vocab_size set to the fp32 minimum (a
    finite value, so that their probability is exactly 0 and 0 * logit stays 0)."""
    x = logits.float()
    if valid_vocab_size is None or vocab_start + x.shape[-1] <= valid_vocab_size:
        return x
    columns = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
    return x.masked_fill(columns >= valid_vocab_size, torch.finfo(torch.float32).min)


def _shifted_and_log_z(
    logits: torch.Tensor, tp_group: ProcessGroup | None, valid_vocab_size: int | None
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tp_rank, x - m [..., V_l], exp(x - m) [..., V_l], log Z [...])`` of the local shard, fp32."""
    tp_rank = _tp_rank(tp_group)
    x = _masked_fp32(logits, tp_rank * logits.shape[-1], valid_vocab_size)  # [..., V_l] fp32
    m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)  # [...]
    shifted = x - m.unsqueeze(-1)  # new tensor: the input is never modified
    exp = shifted.exp()
    log_z = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group).log()  # [...]
    return tp_rank, shifted, exp, log_z


def _tp_rank(group: ProcessGroup | None) -> int:
    return 0 if _group_size(group) == 1 else dist.get_rank(group)


def _chunks(num_rows: int, vocab_local: int) -> list[slice]:
    """Row slices whose fp32 ``[rows, V_l]`` temporaries stay near ``CHUNK_BYTES`` each."""
    rows = max(1, CHUNK_BYTES // (4 * vocab_local))
    return [slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


class _Rows:
    """Recomputes a row chunk's fp32 ``x - m`` and ``p`` from the saved input (forward and backward share it,
    so both see the same bits as the unchunked formulas in the module docstring)."""

    def __init__(self, logits: torch.Tensor, vocab_start: int, valid_vocab_size: int | None, m: torch.Tensor):
        self.logits, self.vocab_start, self.valid, self.m = logits, vocab_start, valid_vocab_size, m

    def shifted(self, rows: slice) -> torch.Tensor:
        x = _masked_fp32(self.logits[rows], self.vocab_start, self.valid)  # [n, V_l] fp32
        return x - self.m[rows].unsqueeze(-1)

    def probs(self, shifted: torch.Tensor, rows: slice, log_z: torch.Tensor) -> torch.Tensor:
        return shifted.exp().div_(log_z[rows].exp().unsqueeze(-1))  # p_j = exp(x_j - m) / exp(log Z)


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """Chunked over rows; saves the input logits and three ``[N]`` fp32 vectors, never an fp32 ``[N, V_l]``."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, compute_entropy, valid_vocab_size):
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)  # [N, V_l] (a view for contiguous logits)
        tp_rank = _tp_rank(tp_group)
        local_label = labels.reshape(-1) - tp_rank * vocab_local  # [N]
        in_shard = (local_label >= 0) & (local_label < vocab_local)
        index = local_label.clamp(0, vocab_local - 1).unsqueeze(-1)  # [N, 1]
        chunks = _chunks(flat.shape[0], vocab_local)

        m = flat.new_empty(flat.shape[0], dtype=torch.float32)
        for rows in chunks:
            m[rows] = _masked_fp32(flat[rows], tp_rank * vocab_local, valid_vocab_size).max(dim=-1).values
        m = _all_reduce(m, dist.ReduceOp.MAX, tp_group)
        rows_of = _Rows(flat, tp_rank * vocab_local, valid_vocab_size, m)

        sum_exp, picked = torch.empty_like(m), torch.empty_like(m)
        for rows in chunks:
            shifted = rows_of.shifted(rows)
            sum_exp[rows] = shifted.exp().sum(dim=-1)
            picked[rows] = shifted.gather(-1, index[rows]).squeeze(-1)
        log_z = _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group).log()  # [N]
        picked = _all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, tp_group)
        logprobs = picked - log_z

        mean_shifted = None
        entropy = logprobs.new_zeros(())
        if compute_entropy:
            mean_shifted = torch.empty_like(m)  # E_p[x - m]
            for rows in chunks:
                shifted = rows_of.shifted(rows)
                mean_shifted[rows] = (rows_of.probs(shifted, rows, log_z) * shifted).sum(dim=-1)
            mean_shifted = _all_reduce(mean_shifted, dist.ReduceOp.SUM, tp_group)
            entropy = (log_z - mean_shifted).view(labels.shape)
        ctx.save_for_backward(logits, m, log_z, mean_shifted, index, in_shard)
        ctx.meta = (tp_rank * vocab_local, valid_vocab_size)
        ctx.set_materialize_grads(False)
        return logprobs.view(labels.shape), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, m, log_z, mean_shifted, index, in_shard = ctx.saved_tensors
        vocab_local = logits.shape[-1]
        rows_of = _Rows(logits.reshape(-1, vocab_local), *ctx.meta, m)
        g_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1)  # [N]
        g_ent = None if grad_entropy is None or mean_shifted is None else grad_entropy.reshape(-1)
        grad_input = torch.empty_like(rows_of.logits)  # [N, V_l], the input's dtype
        for rows in _chunks(grad_input.shape[0], vocab_local):
            shifted = rows_of.shifted(rows)
            probs = rows_of.probs(shifted, rows, log_z)
            grad = torch.zeros_like(probs)
            if g_lp is not None:
                grad -= probs * g_lp[rows].unsqueeze(-1)
                onehot_grad = torch.where(in_shard[rows], g_lp[rows], 0.0).unsqueeze(-1)
                grad.scatter_add_(-1, index[rows], onehot_grad)
            if g_ent is not None:
                grad -= probs * (shifted - mean_shifted[rows].unsqueeze(-1)) * g_ent[rows].unsqueeze(-1)
            grad_input[rows] = grad
        return grad_input.view(logits.shape), None, None, None, None


class _VocabParallelKL(torch.autograd.Function):
    """KL(softmax(x) || softmax(y)) per row, chunked like the log-prob head; saves both inputs and ``[N]``
    vectors (the maxima, log Z of both, the KL), never an fp32 ``[N, V_l]``; no gradient for ``y``."""

    @staticmethod
    def forward(ctx, logits, other, tp_group, valid_vocab_size):
        vocab_local = logits.shape[-1]
        flat, flat_other = logits.reshape(-1, vocab_local), other.reshape(-1, vocab_local)
        start, chunks = _tp_rank(tp_group) * vocab_local, _chunks(flat.shape[0], vocab_local)
        m = flat.new_empty((2, flat.shape[0]), dtype=torch.float32)  # [2, N]: row 0 of x, row 1 of y
        for rows in chunks:
            m[0, rows] = _masked_fp32(flat[rows], start, valid_vocab_size).max(dim=-1).values
            m[1, rows] = _masked_fp32(flat_other[rows], start, valid_vocab_size).max(dim=-1).values
        m = _all_reduce(m, dist.ReduceOp.MAX, tp_group)
        both = (_Rows(flat, start, valid_vocab_size, m[0]), _Rows(flat_other, start, valid_vocab_size, m[1]))
        sum_exp = torch.empty_like(m)
        for rows in chunks:
            for k, of in enumerate(both):
                sum_exp[k, rows] = of.shifted(rows).exp().sum(dim=-1)
        log_z = _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group).log()  # [2, N]
        kl = torch.empty_like(m[0])
        for rows in chunks:
            probs, log_ratio = _kl_parts(both, rows, log_z)
            kl[rows] = (probs * log_ratio).sum(dim=-1)
        kl = _all_reduce(kl, dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(logits, other, m, log_z, kl)
        ctx.meta = (start, valid_vocab_size)
        return kl.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_kl):
        logits, other, m, log_z, kl = ctx.saved_tensors
        vocab_local = logits.shape[-1]
        both = (_Rows(logits.reshape(-1, vocab_local), *ctx.meta, m[0]),
                _Rows(other.reshape(-1, vocab_local), *ctx.meta, m[1]))
        g = grad_kl.reshape(-1)  # [N]
        grad_input = torch.empty_like(both[0].logits)  # [N, V_l], the input's dtype
        for rows in _chunks(grad_input.shape[0], vocab_local):
            probs, log_ratio = _kl_parts(both, rows, log_z)
            grad_input[rows] = probs * (log_ratio - kl[rows].unsqueeze(-1)) * g[rows].unsqueeze(-1)
        return grad_input.view(logits.shape), None, None, None


def _kl_parts(both: tuple[_Rows, _Rows], rows: slice, log_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, log p - log q)`` of a row chunk, fp32 ``[n, V_l]``; padding columns: ``p`` 0 (their log-ratio is
    finite: both sides are the fp32 minimum minus a moderate number)."""
    log_p = both[0].shifted(rows) - log_z[0, rows].unsqueeze(-1)
    log_q = both[1].shifted(rows) - log_z[1, rows].unsqueeze(-1)
    return log_p.exp(), log_p - log_q


def vocab_parallel_kl(
    logits: torch.Tensor, other: torch.Tensor, tp_group: ProcessGroup | None, *, valid_vocab_size: int | None = None
) -> torch.Tensor:
    """The full-vocabulary ``KL(softmax(logits) || softmax(other))`` per position, vocab-sharded inputs.

    Args:
        logits: ``[..., V/tp]`` this rank's vocab shard of p's logits (any float dtype; not modified).
        other: q's logits in the same layout (same shape: the same vocab columns on this rank); no gradient.
        tp_group: the tensor-parallel group the vocab is sharded over (None or size 1: no communication).
        valid_vocab_size: global columns ``>= valid_vocab_size`` are left out of both distributions (both are
            normalized over ``[0, valid_vocab_size)``).

    Returns:
        ``[...]`` fp32, the same on every TP rank, differentiable w.r.t. ``logits`` (local backward, like
        ``vocab_parallel_logprobs_entropy``).
    """
    if other.shape != logits.shape:
        raise ValueError(f"the two logit shards differ in shape ({tuple(logits.shape)} vs {tuple(other.shape)}); "
                         "put both in the same vocab layout first")
    return _VocabParallelKL.apply(logits, other.detach(), tp_group, valid_vocab_size)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: ProcessGroup | None,
    compute_entropy: bool,
    *,
    valid_vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and (optionally) the entropy of the full-vocab softmax.

    Args:
        logits: ``[..., V/tp]`` this rank's vocab shard (any float dtype; not modified).
        labels: ``[...]`` int64 global token ids.
        tp_group: the tensor-parallel group the vocab is sharded over (None or size 1: no communication).
        compute_entropy: also return the entropy (one more all-reduce).
        valid_vocab_size: global columns ``>= valid_vocab_size`` are vocabulary padding and get probability 0.

    Returns:
        ``(logprobs [...] fp32, entropy [...] fp32 or None)``, both differentiable w.r.t. ``logits``.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    logprobs, entropy = _VocabParallelLogprobsEntropy.apply(
        logits, labels.long(), tp_group, compute_entropy, valid_vocab_size
    )
    return logprobs, (entropy if compute_entropy else None)


@torch.no_grad()
def vocab_parallel_log_softmax(
    logits: torch.Tensor, tp_group: ProcessGroup | None, *, valid_vocab_size: int | None = None
) -> torch.Tensor:
    """The full-vocab log-softmax ``(x - m) - log Z``, all-gathered over TP: identical on every TP rank.

    For a few positions only (e.g. the next token of each sampling context): unlike
    ``vocab_parallel_logprobs_entropy`` it materializes ``[..., V]`` on every rank. No gradient.

    Args:
        logits: ``[..., V/tp]`` this rank's vocab shard (any float dtype; not modified).
        tp_group: the tensor-parallel group the vocab is sharded over (None or size 1: no communication).
        valid_vocab_size: global columns ``>= valid_vocab_size`` are vocabulary padding and are dropped.

    Returns:
        ``[..., valid_vocab_size or V]`` fp32; each entry equals ``vocab_parallel_logprobs_entropy``'s log-prob
        of that token id, bit for bit.
    """
    _, shifted, _, log_z = _shifted_and_log_z(logits, tp_group, valid_vocab_size)
    local = shifted - log_z.unsqueeze(-1)  # [..., V_l]
    if _group_size(tp_group) > 1:
        parts = [torch.empty_like(local) for _ in range(_group_size(tp_group))]
        dist.all_gather(parts, local.contiguous(), group=tp_group)
        local = torch.cat(parts, dim=-1)  # [..., V]
    return local[..., :valid_vocab_size] if valid_vocab_size is not None else local
