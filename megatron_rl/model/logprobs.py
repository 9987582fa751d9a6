"""Per-token log-probabilities and entropy from vocab-sharded logits (DESIGN.md section 4).

Place in the data flow: right after the model's last pipeline stage, before the loss. Logits arrive
vocab-sharded over the tensor-parallel group: TP rank r holds columns ``[r*V_l, (r+1)*V_l)`` of the vocab.

    m      = max over the full vocab         (local max, all-reduce MAX)
    Z      = sum_j exp(x_j - m)              (local sum, all-reduce SUM)
    log p(label) = (x_label - m) - log Z     (x_label lives on one rank: masked gather, all-reduce SUM)
    H      = log Z - sum_j p_j (x_j - m)     (local sum, all-reduce SUM)

All in fp32; the full vocab is never gathered; the input logits are never written to (unlike megatron's
``vocab_parallel_cross_entropy``, which overwrites fp32 inputs with the softmax). The backward is local:

    d logp / d x_j = 1[j == label] - p_j          d H / d x_j = -p_j (x_j - sum_k p_k x_k)

``vocab_parallel_log_softmax`` returns the whole row ``(x - m) - log Z`` (all-gathered over TP), for the few
positions where a sampler needs the full distribution.

Labels outside ``[0, V)`` (e.g. a masked position's filler) give a meaningless value and no error: mask them
afterwards. ``valid_vocab_size`` excludes vocabulary padding columns (see ``model.builder.padded_vocab_size``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


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
    tp_rank = 0 if _group_size(tp_group) == 1 else dist.get_rank(tp_group)
    x = _masked_fp32(logits, tp_rank * logits.shape[-1], valid_vocab_size)  # [..., V_l] fp32
    m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)  # [...]
    shifted = x - m.unsqueeze(-1)  # new tensor: the input is never modified
    exp = shifted.exp()
    log_z = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group).log()  # [...]
    return tp_rank, shifted, exp, log_z


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, compute_entropy, valid_vocab_size):
        vocab_local = logits.shape[-1]
        tp_rank, shifted, exp, log_z = _shifted_and_log_z(logits, tp_group, valid_vocab_size)

        local_label = labels - tp_rank * vocab_local
        in_shard = (local_label >= 0) & (local_label < vocab_local)
        picked = shifted.gather(-1, local_label.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, tp_group)
        logprobs = picked - log_z

        probs = exp.div_(log_z.exp().unsqueeze(-1))  # p_j, in exp's storage
        mean_shifted = None
        entropy = logprobs.new_zeros(())
        if compute_entropy:
            mean_shifted = _all_reduce((probs * shifted).sum(dim=-1), dist.ReduceOp.SUM, tp_group)  # E_p[x - m]
            entropy = log_z - mean_shifted
        ctx.save_for_backward(probs, shifted if compute_entropy else None, mean_shifted,
                              local_label, in_shard)
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
