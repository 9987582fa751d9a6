"""Collectives of context parallelism (docs/DESIGN.md "Context parallelism"): autograd-aware gathers over the
CP group between a CP rank's local tokens (``data.packing.split_for_cp``) and the whole pack.

    all_gather_cp(x, group, grad="reduce")   [n, ...] -> [cp*n, ...] rank-major. Backward: the sum over CP
                                             ranks of the gradient, this rank's slice (a reduce-scatter,
                                             written as all_reduce + slice so gloo runs it). For keys/values:
                                             every rank's queries contribute to every rank's keys.
    all_gather_cp(x, group, grad="own")      same forward; backward: this rank's slice of its OWN gradient.
                                             For outputs from which EVERY CP rank computes the same loss: the
                                             gradient w.r.t. the gathered tensor is identical on all CP ranks,
                                             so each keeps its slice (summing would count it cp times).
    gather_tokens(values, local, group)      per-token values [1, T/cp] -> [1, T] in global pack order
    select_positions(rows, positions, ...)   rows [T/cp, ...] at GLOBAL positions -> [k, ...] on every CP rank

Plain ``torch.distributed`` (all_gather, all_reduce), so gloo (CPU) and NCCL both run it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.data.packing import CPLocalPack


class _AllGatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce_grad: bool) -> torch.Tensor:
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.reduce_grad, ctx.rank, ctx.n = group, reduce_grad, dist.get_rank(group), x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_grad:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None


def all_gather_cp(x: torch.Tensor, group: dist.ProcessGroup, *, grad: str) -> torch.Tensor:
    """``x [n, ...]`` of every CP rank concatenated rank-major ``[cp*n, ...]``; ``grad`` is ``"reduce"`` or
    ``"own"`` (module docstring)."""
    assert grad in ("reduce", "own"), grad
    return _AllGatherCP.apply(x, group, grad == "reduce")


def to_global_order(gathered: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rank-major ``[cp*n, ...]`` (``all_gather_cp``) -> global pack order ``[T, ...]`` (differentiable);
    ``order`` is ``data.packing.cp_global_order`` of the pack (``CPLocalPack.cp_order``)."""
    return gathered.index_select(0, order)


def gather_tokens(values: torch.Tensor, local: CPLocalPack, group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token ``values [1, T/cp]`` of this CP rank -> ``[1, T]`` of the whole pack, the same on every CP rank.

    Backward keeps this rank's slice of its own gradient (``grad="own"``): use it for outputs from which every
    CP rank computes the same loss (model/scaling.py)."""
    gathered = all_gather_cp(values.reshape(-1), group, grad="own")  # [T] rank-major
    return to_global_order(gathered, local.cp_order)[None]


@torch.no_grad()
def select_positions(
    rows: torch.Tensor, positions: torch.Tensor, local: CPLocalPack, group: dist.ProcessGroup
) -> torch.Tensor:
    """``rows [T/cp, ...]`` (this CP rank's tokens) at GLOBAL pack ``positions [k]`` -> ``[k, ...]`` on every CP
    rank: the owner contributes the row, the others zeros, summed over CP (exact: x + 0 = x). No gradient."""
    mine = local.cp_index[local.cp_rank]  # [T/cp] global position of each local row
    where = torch.full((local.total_len * local.cp_size,), -1, dtype=torch.long, device=rows.device)
    where[mine] = torch.arange(mine.numel(), device=rows.device)
    local_row = where[positions.long()]  # [k], -1 where another rank owns the position
    picked = rows[local_row.clamp(min=0)]
    owned = (local_row >= 0).view(-1, *([1] * (rows.dim() - 1)))
    picked = torch.where(owned, picked, torch.zeros((), dtype=rows.dtype, device=rows.device)).contiguous()
    dist.all_reduce(picked, group=group)
    return picked
