"""MoE routing replay (R2 and R3): megatron-core's ``RouterReplay`` driven per packed micro-batch (docs/MOE.md).

Place in the data flow (docs/DESIGN.md section 1; ``model.moe_router_replay``)::

    R2  Trainer.add_old_and_ref_logprobs -> policy.forward(batch, record_routing=True)
          forward_step: RECORD, then each router's top-k [T_local, k] -> (row, column) of the [B, S] block
          -> one all-reduce MAX over the world -> batch["routed_experts"] [B, S, L, k] (host, left-padded)
    R3  GeneratorOutput["routed_experts"] (the engine's routing) -> TrainingBatch["routed_experts"] [B, S, L, k]
    both: policy.forward / forward_backward of a batch holding "routed_experts" (role "policy" only):
          forward_step: rows of this micro-batch -> its packed token order, the tokens this rank's routers see
          (CP: ``cp_local.cp_index``; SP: the TP rank's slice) -> REPLAY_FORWARD; padding tokens get experts
          0..k-1. Each router also computes (no grad) the top-k the current weights would choose:
          ``moe/replay_topk_mismatch_frac``.

``routed_experts[i, c, l, :]`` are the top-k experts of MoE layer ``l`` (0-based over the whole model, every layer
is MoE) for the token ``sequences[i, c]``; columns left of a row's tokens are padding (any value). Dtype uint8
for up to 256 experts, else int32 (what gloo and NCCL all-reduce).

megatron-core's static ``RouterReplay`` methods (``set_replay_data``, ``set_global_router_replay_action``) act on
``global_router_replay_instances``, the routers of EVERY model built in the process (policy, reference, critic).
We call the same per-instance methods (``set_target_indices``, ``set_router_replay_action``, ``clear_*``) on the
policy's own routers only, so a reference model never records or consumes (W24 in docs/MEGATRON_CORE.md).
The router keeps its gradient under replay: megatron gathers the probabilities from the current scores at the
replayed indices. Replay state is cleared after every call (``ReplayCall.close``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rl.config import ModelConfig
from megatron_rl.metrics import Metric
from megatron_rl.model.moe import rank_tokens

ROUTED_EXPERTS = "routed_experts"
"""The batch key of the per-token routing ``[B, S, L, k]``."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype of a routing table (uint8 up to 256 experts; gloo has no int16 reduction)."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def routing_shape(model_cfg: ModelConfig) -> tuple[int, int]:
    """``(L, k)``: MoE layers (every layer of an MoE model) and experts per token."""
    return model_cfg.num_layers, model_cfg.moe_router_topk


def validate_routing(batch: Any, model_cfg: ModelConfig) -> None:
    """ValueError naming ``batch['routed_experts']`` unless it is ``[B, S, L, k]`` integer with experts in
    ``[0, num_moe_experts)`` on every valid token (host check, before any collective)."""
    routing = batch[ROUTED_EXPERTS]
    layers, topk = routing_shape(model_cfg)
    want = (*batch["sequences"].shape, layers, topk)
    if tuple(routing.shape) != want:
        raise ValueError(f"batch['routed_experts'] has shape {tuple(routing.shape)}, expected [B, S, L, k] = {want} "
                         "(one top-k per token of `sequences` and MoE layer, left-padded like `sequences`)")
    if routing.dtype.is_floating_point or routing.dtype == torch.bool:
        raise ValueError(f"batch['routed_experts'] has dtype {routing.dtype}; expert ids must be integers")
    valid = routing[batch["attention_mask"].bool()]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= model_cfg.num_moe_experts):
        raise ValueError(f"batch['routed_experts'] holds expert ids in [{int(valid.min())}, {int(valid.max())}], "
                         f"outside [0, model.num_moe_experts={model_cfg.num_moe_experts})")


# ------------------------------------------------------------------------------------------------ the routers


class _ObservedRouterReplay(RouterReplay):
    """megatron-core's ``RouterReplay`` plus, when replaying, the top-k the current scores would give (no grad),
    handed to ``observe(free [n, k], replayed [n, k])``. W23 in docs/MEGATRON_CORE.md: megatron computes no free
    top-k under replay and has no hook for one; ``get_replay_topk`` receives megatron's own top-k function, so
    the comparison uses exactly its routing (score function, expert bias, groups)."""

    observe: Any = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, indices = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.observe is not None and self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, free = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
            self.observe(free, indices)
        return probs, indices


def policy_routers(module: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
    """``(layer index 0..L-1 over the whole model, RouterReplay)`` of this PP stage's routers, in layer order.

    Their instances become ``_ObservedRouterReplay`` (W23: the class of megatron's own instance is swapped, so
    megatron's global list and the router keep pointing at the same object)."""
    found = []
    for router in module.modules():
        if isinstance(router, TopKRouter) and router.router_replay is not None:
            router.router_replay.__class__ = _ObservedRouterReplay
            found.append((router.layer_number - 1, router.router_replay))
    return sorted(found, key=lambda pair: pair[0])


# ------------------------------------------------------------------------------------------------ per call


class ReplayCall:
    """Routing replay or recording over one policy call (one ``plan_call``); built by the policy, used by
    ``model/schedule.py forward_step`` through ``micro_batch(item)``.

    ``record``: record (R2's old-log-prob forward); else replay ``item.tensors['routed_experts']``.
    """

    def __init__(self, routers: list[tuple[int, RouterReplay]], *, record: bool, num_rows: int, width: int,
                 model_cfg: ModelConfig, groups: Any) -> None:
        self.routers, self.record, self.num_rows, self.width = routers, record, num_rows, width
        self.num_layers, self.topk = routing_shape(model_cfg)
        self.dtype = routing_dtype(model_cfg.num_moe_experts)
        self.groups = groups
        sp = groups.sequence_parallel and groups.tp_size > 1
        self.sp_rank, self.sp_size = (groups.tp_rank, groups.tp_size) if sp else (0, 1)
        self.recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.counts = torch.zeros(2, dtype=torch.float64, device=groups.device)  # changed, (token, layer) pairs
        action = RouterReplayAction.RECORD if record else RouterReplayAction.REPLAY_FORWARD
        for _, replay in routers:
            replay.set_router_replay_action(action)

    @contextlib.contextmanager
    def micro_batch(self, item: Any) -> Iterator[None]:
        """Around one micro-batch's forward: set its replay targets, or collect what its routers recorded."""
        rows, columns, real = self.router_tokens(item)
        if not self.record:
            self._set_targets(item.tensors[ROUTED_EXPERTS], rows, columns, real)
        yield
        if self.record:
            recorded = torch.stack([replay.get_recorded_indices() for _, replay in self.routers], dim=1)
            global_rows = torch.as_tensor(item.rows, dtype=torch.long, device=rows.device)[rows[real]]
            self.recorded.append((global_rows, columns[real], recorded[real]))  # [n], [n], [n, L_local, k]

    def router_tokens(self, item: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each token the routers of this rank see (``[n]`` each): its row in the micro-batch, its column in
        the ``[B, S]`` block, and whether it is a real token of a caller's row (not alignment, CP/SP, DP padding).

        Token order: the pack (docs/DESIGN.md section 3), then this CP rank's chunks (``cp_index``), then the
        sequence-parallel slice of this TP rank (the router's input is scattered along the sequence)."""
        segment, position = rank_tokens(item, self.num_rows)  # [T_local] row (-1: padding), offset in the row
        if self.sp_size > 1:
            n = len(segment) // self.sp_size
            segment, position = (x[self.sp_rank * n:(self.sp_rank + 1) * n] for x in (segment, position))
        real = segment >= 0
        rows = segment.clamp(min=0)
        length = item.packed.seq_lens.to(segment.device)[rows.clamp(max=len(item.packed.seq_lens) - 1)]
        columns = (self.width - length + position).clamp(0, self.width - 1)
        return rows, columns, real

    def _set_targets(self, table: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, real: torch.Tensor
                     ) -> None:
        """``table [b, S, L, k]`` at the routers' tokens -> each router's REPLAY_FORWARD target ``[n, k]``."""
        picked = table[rows, columns].long()  # [n, L, k]
        padding = torch.arange(self.topk, device=picked.device).expand_as(picked)
        picked = torch.where(real[:, None, None], picked, padding)
        for layer, replay in self.routers:
            replay.set_target_indices(picked[:, layer].contiguous())
            replay.observe = lambda free, used, real=real: self._count(free, used, real)

    def _count(self, free: torch.Tensor, used: torch.Tensor, real: torch.Tensor) -> None:
        differs = (free.sort(dim=-1).values != used.sort(dim=-1).values).any(dim=-1) & real
        self.counts += torch.stack([differs.sum(), real.sum()]).to(self.counts)

    def recorded_table(self) -> torch.Tensor:
        """The recording of the whole call: ``[B, S, L, k]`` on the host, the same on every rank (collective:
        every rank holds some tokens of some layers; an all-reduce MAX over the world joins them, entries
        nobody wrote stay 0)."""
        device = self.groups.device
        table = torch.zeros(self.num_rows, self.width, self.num_layers, self.topk, dtype=self.dtype, device=device)
        layers = torch.as_tensor([layer for layer, _ in self.routers], dtype=torch.long, device=device)
        for rows, columns, recorded in self.recorded:
            table[rows[:, None], columns[:, None], layers[None, :]] = recorded.to(device, self.dtype)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return table.cpu()

    def metrics(self) -> dict[str, Metric]:
        """``moe/replay_topk_mismatch_frac``: (token, layer) pairs whose replayed top-k set differs from the one
        the current weights choose, over those of the call (collective; the same on every rank). Every rank
        holding a copy of a token (TP without SP) counts it in both sums, so the ratio is exact."""
        counts = self.counts.clone()
        dist.all_reduce(counts)
        changed, total = counts.tolist()
        return {"moe/replay_topk_mismatch_frac": Metric(changed, total, "mean")}

    def close(self) -> None:
        """Clear the routers' action, targets and recordings. W25 in docs/MEGATRON_CORE.md (0.16.1, 0.19.2):
        megatron keeps them, and appends every target to ``replay_backward_list``; remove when it clears per
        step itself."""
        for _, replay in self.routers:
            replay.clear_router_replay_action()
            replay.clear_indices()
            replay.observe = None
        self.recorded = []
