"""Mixture-of-experts: the MoE layer spec, the router with layout-invariant auxiliary losses (docs/MOE.md).

Place in the data flow: called by ``model/builder.py`` when ``model.num_moe_experts`` is set; the policy's forward
step (``model/schedule.py``) tells the routers which sequence each of its tokens belongs to (``tokens_of``).

megatron-core's MoE layer (local spec: ``SequentialMLP`` experts, the alltoall dispatcher, ``TopKRouter``) is
used as shipped, with one substitution: the router is ``PackedSequenceRouter``, which adds the auxiliary losses
itself. megatron-core's own ``aux_loss`` is a nonlinear function of a micro-batch's token set (the product of
the expert load and the mean score, over the micro-batch): its value, and so the gradient, changes with how
sequences are packed into micro-batches and split over DP ranks. Ours are defined per sequence and per token of
the call's whole batch, so the objective is the same for any packing, micro-batch count and DP/TP/CP/EP/PP layout:

    J_aux = moe_aux_loss_coeff / N_seq * sum over sequences s of  E / (k T_s^2) * sum_i P_i(s) c_i(s)
    J_z   = moe_z_loss_coeff   / N_tok * sum over tokens t of  logsumexp(router logits_t)^2

per MoE layer, where N_seq and N_tok are the sequences and tokens of the ``forward_backward`` call (its whole
global batch; padding excluded), T_s the tokens of sequence s, P_i(s) the sum of expert i's router score over
s's tokens and c_i(s) how many of s's tokens pick i in their top-k (megatron-core's switch loss of one sequence,
its ``seq_aux_loss``). Counts are all-reduced over the ranks holding parts of a sequence (CP, and TP under
sequence parallelism); each rank adds the part of the sum over its own tokens.

Gradient scaling (model/scaling.py has the derivation): the terms are attached to the router's probabilities by
``_AddLossGradient``, which injects ``grad_scale`` = dp * cp as their gradient. megatron-core's schedule does not
touch them (its ``MoEAuxLossAutoScaler`` is unused: our router hands it coefficient 0), and DDP's mean over DP x CP
(dense and expert gradients alike) then leaves exactly the gradient of J_aux + J_z.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.model import scaling


def transformer_config_kwargs(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> dict[str, Any]:
    """megatron-core TransformerConfig fields of an MoE model ({} for a dense one).

    megatron-core's own auxiliary losses stay off (coefficient 0, type "none"): ``PackedSequenceRouter`` adds ours.
    """
    if model_cfg.num_moe_experts is None:
        return {}
    return {
        "num_moe_experts": model_cfg.num_moe_experts,
        "moe_ffn_hidden_size": model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        "moe_router_topk": model_cfg.moe_router_topk,
        "moe_router_score_function": model_cfg.moe_router_score_function,
        "moe_router_pre_softmax": model_cfg.moe_router_pre_softmax,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_grouped_gemm": False,  # the local spec has SequentialMLP only (grouped GEMM is TE's)
        "moe_enable_routing_replay": model_cfg.moe_router_replay != "none",
        "expert_model_parallel_size": parallel_cfg.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel_cfg.expert_tensor_size,
    }


def validate(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, on_cpu: bool = False) -> None:
    """ValueError naming the field for an MoE layout that cannot be built (or EP on a dense model); ``on_cpu``:
    the ranks run on CPU with gloo (no expert tensor parallelism there)."""
    ep = parallel_cfg.expert_model_parallel_size
    if model_cfg.num_moe_experts is None:
        if ep > 1:
            raise ValueError(f"parallel.expert_model_parallel_size={ep} needs an MoE model; set model.num_moe_experts "
                             "or expert_model_parallel_size=1")
        return
    if model_cfg.num_moe_experts % ep != 0:
        raise ValueError(f"model.num_moe_experts={model_cfg.num_moe_experts} is not divisible by "
                         f"parallel.expert_model_parallel_size={ep}; choose an EP size dividing the expert count")
    if parallel_cfg.tensor_model_parallel_size > 1 and not parallel_cfg.sequence_parallel:
        raise ValueError(f"parallel.tensor_model_parallel_size={parallel_cfg.tensor_model_parallel_size} with "
                         "model.num_moe_experts needs parallel.sequence_parallel=true (megatron-core's MoE layer "
                         "refuses tensor parallelism without it)")
    etp = parallel_cfg.expert_tensor_size
    if on_cpu and etp > 1:
        raise ValueError(
            f"parallel.expert_tensor_parallel_size={etp} needs CUDA: on CPU, gloo has no uneven all-gather "
            "(megatron-core's dispatcher gathers each expert's tokens over that group); set "
            "parallel.expert_tensor_parallel_size=1"
        )
    ffn = model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
    if ffn % etp != 0:
        raise ValueError(f"model.moe_ffn_hidden_size={ffn} is not divisible by expert_tensor_parallel_size={etp}")
    if model_cfg.attention_backend == "te":
        raise ValueError("model.attention_backend='te' with num_moe_experts: the MoE layer uses megatron-core's "
                         "local spec only; set attention_backend='local'")


def _define_te_general_gemm() -> None:
    """Workaround W26 (docs/MEGATRON_CORE.md; megatron-core 0.16.1): ``moe_utils`` binds ``te_general_gemm`` only when
    TransformerEngine imports, yet the router's gating linear reads it unconditionally (``moe_utils.py:1192``), a
    NameError without TE. Binding it to None selects the plain matmul branch, as 0.19.2 does itself. Removal: when
    0.16.1 leaves the supported range (0.19.2 defines the name in both branches)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def reduce_dense_marked_experts(model: torch.nn.Module, parallel_cfg: ParallelConfig) -> None:
    """Workaround W27 (docs/MEGATRON_CORE.md; megatron-core 0.16.1): at EP=1 0.16.1 marks expert weights as dense
    parameters (``allreduce=True``: ``tensor_parallel/layers.py:886,1209`` and ``moe/experts.py:89`` take "expert
    parallel" to mean EP > 1), so DDP reduces them over DP only. With TP > 1 (sequence parallel) and expert TP 1,
    each TP rank's expert gradient comes from its own slice of the tokens and must be summed over TP, which
    0.19.2 does through the expert-data-parallel group. Tagging them ``sequence_parallel`` makes
    ``finalize_model_grads`` sum them over TP. A no-op where experts are marked (0.19.2, or EP > 1). Removal: when
    0.16.1 leaves the supported range."""
    if parallel_cfg.tensor_model_parallel_size == 1 or parallel_cfg.expert_tensor_size > 1:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name and getattr(param, "allreduce", True):
            param.sequence_parallel = True


def moe_mlp_spec(qk_layernorm: bool) -> Any:
    """megatron-core's local MoE MLP spec (SequentialMLP experts, alltoall dispatcher) with our router."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _define_te_general_gemm()

    mlp = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                   normalization="RMSNorm").submodules.mlp  # the count is read from the config
    # 0.19.2: partial(MoELayer, submodules=...); 0.16.1: ModuleSpec(module=MoELayer, submodules=...)
    submodules = mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules
    submodules.router = PackedSequenceRouter
    return mlp


# ------------------------------------------------------------------------------------------------ token context


@dataclass
class MoETokens:
    """What the routers of one micro-batch's forward need to know about its tokens (set by the forward step)."""

    segment_ids: torch.Tensor
    """``[T_local]`` int64: the row of each token this rank runs (before the sequence-parallel split), -1 for
    padding."""
    seq_lens: torch.Tensor
    """``[b]`` float: tokens of each row (the whole sequence, over every CP rank)."""
    inv_num_seqs: float
    """1 / sequences of the whole call (all DP ranks)."""
    inv_num_tokens: float
    """1 / tokens of the whole call."""
    grad_scale: float
    """dp * cp: cancels DDP's mean over DP x CP (model/scaling.py)."""
    sp_rank: int = 0
    sp_size: int = 1
    count_group: Any = None
    """Ranks holding parts of the same sequences (CP; TP x CP under sequence parallelism); None = this rank."""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached per-rank partial sums (``load_balancing_loss``, ``z_loss``), summed over layers."""

    def local_segments(self, num_tokens: int) -> torch.Tensor:
        """The segment ids of the ``num_tokens`` tokens the router sees (its sequence-parallel slice)."""
        if self.sp_size == 1:
            assert num_tokens == len(self.segment_ids), (num_tokens, len(self.segment_ids))
            return self.segment_ids
        return self.segment_ids[self.sp_rank * num_tokens:(self.sp_rank + 1) * num_tokens]


_CURRENT: MoETokens | None = None


@contextlib.contextmanager
def tokens_of(tokens: MoETokens | None) -> Iterator[None]:
    """Make ``tokens`` what the routers see during one micro-batch's forward (nested use restores the outer)."""
    global _CURRENT
    outer, _CURRENT = _CURRENT, tokens
    try:
        yield
    finally:
        _CURRENT = outer


def segment_ids(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, total_len: int) -> torch.Tensor:
    """``[total_len]`` int64: the row of each position of a pack, -1 for alignment padding and a dummy tail."""
    cu = cu_seqlens.to(torch.int64)
    rows = len(seq_lens)
    position = torch.arange(total_len, device=cu.device)
    row = torch.searchsorted(cu[1:], position, right=True)  # the packed sequence holding the position
    inside = (row < rows) & (position - cu[row.clamp(max=len(cu) - 2)] < seq_lens.to(cu.device)[row.clamp(max=rows - 1)])
    return torch.where(inside, row, torch.full_like(row, -1))


def rank_tokens(item: Any, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, position)`` ``[T_local]`` of the tokens this rank runs for micro-batch ``item`` (``model/plan.py``
    MicroBatch; this CP rank's chunks under context parallelism, before any sequence-parallel split): the token's
    row in the micro-batch, -1 for padding (alignment, a dummy tail, DP padding rows: global row >= ``num_rows``),
    and its offset in that row. Shared by the auxiliary losses and routing replay (model/router_replay.py)."""
    packed = item.packed
    row = segment_ids(packed.cu_seqlens, packed.seq_lens, packed.input_ids.shape[1])
    real = torch.zeros(packed.num_rows + 1, dtype=torch.bool, device=row.device)  # last slot: padding (-1)
    real[: len(item.rows)] = torch.tensor([r < num_rows for r in item.rows], dtype=torch.bool)
    row = torch.where(real[row], row, torch.full_like(row, -1))
    position = packed.position_ids[0].to(row.device)
    if item.cp_local is not None:
        index = item.cp_local.cp_index[item.cp_local.cp_rank].to(row.device)
        row, position = row[index], position[index]
    return row, position


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``activation``; in backward, ``loss`` receives the gradient ``grad_scale`` (a loss term that
    is not part of the value handed to the schedule)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.grad_scale = grad_scale
        return activation

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.grad_scale), None


class PackedSequenceRouter(TopKRouter):
    """megatron-core's TopKRouter plus the per-sequence load-balancing loss and the per-token z-loss of the
    module doc (routing itself, router replay included, is megatron-core's)."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        spec = _moe_losses(self.config)
        if not (spec and self.training and torch.is_grad_enabled()):
            return probs, routing_map
        tokens = _CURRENT
        if tokens is None:
            raise RuntimeError("the MoE auxiliary losses need megatron_rl's forward step (model/schedule.py), which "
                               "tells the router the sequence of each token; none is set")
        flat = logits.reshape(-1, self.config.num_moe_experts).float()
        loss = _aux_and_z_loss(flat, tokens, spec, self.topk, self.config.moe_router_score_function)
        return _AddLossGradient.apply(probs, loss, tokens.grad_scale), routing_map


def _loss_spec(model_cfg: ModelConfig) -> _LossSpec:
    return _LossSpec(
        aux_coeff=model_cfg.moe_aux_loss_coeff if model_cfg.moe_router_load_balancing_type != "none" else 0.0,
        z_coeff=model_cfg.moe_z_loss_coeff or 0.0,
    )


def losses_enabled(model_cfg: ModelConfig) -> bool:
    """Whether an MoE model has a load-balancing or z-loss term."""
    return bool(_loss_spec(model_cfg))


def configure_losses(config: Any, model_cfg: ModelConfig) -> None:
    """Attach ``model_cfg``'s auxiliary-loss settings to the TransformerConfig (our routers read them)."""
    config.megatron_rl_moe_losses = _loss_spec(model_cfg)


@dataclass(frozen=True)
class _LossSpec:
    aux_coeff: float
    z_coeff: float

    def __bool__(self) -> bool:
        return self.aux_coeff > 0 or self.z_coeff > 0


def _moe_losses(config: Any) -> _LossSpec | None:
    return getattr(config, "megatron_rl_moe_losses", None)


def _aux_and_z_loss(flat: torch.Tensor, tokens: MoETokens, spec: _LossSpec, topk: int, score_function: str
                    ) -> torch.Tensor:
    """This rank's part of J_aux + J_z (module doc) for one layer's router logits ``flat [n, E]``."""
    seg = tokens.local_segments(flat.shape[0]).to(flat.device)
    valid = seg >= 0
    loss = flat.new_zeros(())
    if spec.z_coeff > 0:
        z = torch.logsumexp(flat, dim=-1).square()
        z_part = (z * valid).sum() * tokens.inv_num_tokens
        loss = loss + spec.z_coeff * z_part
        _accumulate(tokens, "z_loss", z_part)
    if spec.aux_coeff > 0:
        num_experts = flat.shape[1]
        if score_function == "softmax":
            scores = torch.softmax(flat, dim=-1)
        else:
            scores = torch.sigmoid(flat)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter_(1, scores.topk(topk, dim=-1).indices, 1.0)
        rows, seg_valid = len(tokens.seq_lens), seg[valid]
        counts = torch.zeros(rows, num_experts, device=flat.device).index_add_(0, seg_valid, chosen[valid])
        if tokens.count_group is not None:
            dist.all_reduce(counts, group=tokens.count_group)
        score_sums = flat.new_zeros(rows, num_experts).index_add(0, seg_valid, scores[valid])
        seq_lens = tokens.seq_lens.to(flat.device, torch.float32).clamp(min=1)
        per_seq = (score_sums * counts).sum(dim=-1) * num_experts / (topk * seq_lens.square())
        aux_part = per_seq.sum() * tokens.inv_num_seqs
        loss = loss + spec.aux_coeff * aux_part
        _accumulate(tokens, "load_balancing_loss", aux_part)
    return loss


def _accumulate(tokens: MoETokens, name: str, value: torch.Tensor) -> None:
    value = value.detach()
    tokens.stats[name] = tokens.stats[name] + value if name in tokens.stats else value


# ------------------------------------------------------------------------------------------------ per call


@dataclass
class CallTokens:
    """The call-level numbers every micro-batch's ``MoETokens`` shares (built by the policy per call)."""

    num_seqs: int
    num_tokens: int
    grad_scale: float
    sp_rank: int
    sp_size: int
    count_group: Any
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def for_micro_batch(self, item: Any) -> MoETokens:
        """``MoETokens`` of one micro-batch (``model/plan.py`` MicroBatch): segment ids of the tokens it runs."""
        seg, _ = rank_tokens(item, self.num_seqs)
        return MoETokens(
            segment_ids=seg, seq_lens=item.packed.seq_lens.float(), inv_num_seqs=1.0 / max(self.num_seqs, 1),
            inv_num_tokens=1.0 / max(self.num_tokens, 1), grad_scale=self.grad_scale, sp_rank=self.sp_rank,
            sp_size=self.sp_size, count_group=self.count_group, stats=self.stats,
        )


def call_tokens(num_seqs: int, num_tokens: int, groups: Any) -> CallTokens:
    """The ``CallTokens`` of a call over ``num_seqs`` sequences of ``num_tokens`` tokens on ``groups``' layout."""
    from megatron.core import parallel_state

    sp = groups.sequence_parallel and groups.tp_size > 1
    if sp and groups.cp_size > 1:
        count_group = parallel_state.get_tensor_and_context_parallel_group()
    elif sp:
        count_group = groups.tp_group
    else:
        count_group = groups.cp_group if groups.cp_size > 1 else None
    return CallTokens(
        num_seqs=num_seqs, num_tokens=num_tokens, grad_scale=scaling.moe_grad_scale(groups.dp_size, groups.cp_size),
        sp_rank=groups.tp_rank if sp else 0, sp_size=groups.tp_size if sp else 1, count_group=count_group,
    )


def loss_metrics(call: CallTokens, groups: Any, num_layers: int) -> dict[str, float]:
    """``{"moe/load_balancing_loss", "moe/z_loss"}`` of a call: J_aux / coeff and J_z / coeff averaged over the
    layers (collective over the world; the same on every rank). Only the enabled losses appear."""
    names = sorted(call.stats)
    values = torch.stack([call.stats[n].float() for n in names]) if names else torch.zeros(0)
    if not (groups.sequence_parallel and groups.tp_size > 1):
        values = values / groups.tp_size  # every TP rank holds the whole value
    values = values.to(groups.device)
    dist.all_reduce(values)
    return {f"moe/{n}": float(v) / num_layers for n, v in zip(names, values.tolist())}
