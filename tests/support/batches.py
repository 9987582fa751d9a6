"""Hand-built left-padded batches for tests (the layout of docs/DESIGN.md section 2, without the data layer).

Built row by row on purpose: tests of the model and checkpoint code should not depend on the conversion code
they are not testing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def left_padded_tensors(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    vocab: int,
    generator: torch.Generator,
    *,
    low: int = 1,
    loss_drop: float = 0.0,
    advantages: bool = False,
) -> dict[str, torch.Tensor]:
    """``sequences`` / ``attention_mask`` [B, S] left-padded, ``response_mask`` / ``loss_mask`` [B, R]
    right-aligned; token ids in ``[low, vocab)``; each response token's loss mask is dropped with probability
    ``loss_drop``; ``advantages`` [B, R] (standard normal on response tokens) when asked."""
    rows = len(prompt_lens)
    width = max(p + r for p, r in zip(prompt_lens, response_lens))
    resp = max(response_lens)
    t = {
        "sequences": torch.zeros(rows, width, dtype=torch.long),
        "attention_mask": torch.zeros(rows, width, dtype=torch.long),
        "response_mask": torch.zeros(rows, resp, dtype=torch.long),
        "loss_mask": torch.zeros(rows, resp),
    }
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        t["sequences"][i, width - p - r :] = torch.randint(low, vocab, (p + r,), generator=generator)
        t["attention_mask"][i, width - p - r :] = 1
        t["response_mask"][i, resp - r :] = 1
        t["loss_mask"][i, resp - r :] = (torch.rand(r, generator=generator) >= loss_drop).float()
    if advantages:
        t["advantages"] = torch.randn(rows, resp, generator=generator) * t["response_mask"]
    return t


def training_batch(tensors: dict[str, torch.Tensor]):
    """A ``TrainingBatch`` of ``tensors`` with one uid / trajectory per row, every row a last step."""
    from megatron_rl.data.batch import TrainingBatch

    n = tensors["sequences"].shape[0]
    return TrainingBatch(dict(tensors), list(range(n)), list(range(n)), [True] * n)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Finalized main grads of a ``MegatronPolicy`` (or critic) in the single-process state-dict layout (its
    params temporarily view their grads)."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad.view_as(p)
        return {k: v.clone() for k, v in model.full_state_dict().items()}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def micro_batch_size(num_rows: int, dp_size: int, count: int) -> int:
    """Rows per micro-batch that give ``count`` micro-batches on each of ``dp_size`` shards of ``num_rows``."""
    shard = -(-num_rows // dp_size)
    return -(-shard // count)


def max_rel_err(got: dict, ref: dict) -> float:
    """||got - ref|| / ||ref|| over all tensors of ``ref`` (``got`` may hold extra buffers)."""
    assert set(ref) <= set(got), sorted(set(ref) - set(got))
    num = math.sqrt(sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref))
    den = math.sqrt(sum(float(ref[k].pow(2).sum()) for k in ref))
    return num / den


def summed_pg_loss(logprobs, entropy, mb, loss_config):
    """The summed policy-gradient loss ``-sum(logprobs * advantages * loss_mask)`` (megatron_rl's loss contract:
    a sum, never a mean) with its one ``sum`` metric; a ``loss_fn`` for ``MegatronPolicy.forward_backward``."""
    from megatron_rl.metrics import Metric

    loss = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum")}


def steps_per_count(policy, batch, groups, counts, loss_fn) -> dict:
    """The summed loss and the finalized gradients of one ``forward_backward`` per micro-batch count in ``counts``
    (``loss_<n>``, ``grad_<n>``), then the grad norm of one optimizer step (``grad_norm``): what the layout tests
    compare with the single process."""
    out = {}
    for count in counts:
        policy.config.batch.micro_batch_size = micro_batch_size(len(batch), groups.dp_size, count)
        out[f"loss_{count}"] = float(policy.forward_backward(batch, loss_fn, None)["loss"].value)
        policy.finalize_grads()
        out[f"grad_{count}"] = full_grads(policy)
        policy.zero_grad()
    policy.forward_backward(batch, loss_fn, None)
    out["grad_norm"] = policy.optim_step()["grad_norm"]
    return out
