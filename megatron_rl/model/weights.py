"""Full (un-sharded) state dicts of a TP/PP-sharded GPTModel, and sharding one back in.

Place in the data flow: beside the model. Layout-parity tests build one single-process model, take its state
dict, and load it into a TP/PP layout (``load_full_state_dict``); HF import/export can go through the same
two functions. ``full_state_dict`` has the keys and shapes of a TP1/PP1 model of the same spec:

    tensor-parallel params   (``param.tensor_model_parallel``) split along ``param.partition_dim`` into
                             ``tp`` equal chunks, rank r holding chunk r; except
    gated fc1 (SwiGLU)       full ``[gate; up]`` (``[2*ffn, h]``); rank r holds ``[gate_r; up_r]`` where
                             gate_r, up_r are chunk r of gate and up (each rank applies silu(gate) * up to
                             its own half), so chunking the full tensor directly would be wrong
    qkv                      per-query-group [q; k; v] rows, groups contiguous: plain chunking is right
    Gated-DeltaNet           ``in_proj`` full ``[q; k; v; z; beta; alpha]``, ``conv1d`` full ``[q; k; v]``
                             channels: like gated fc1, rank r holds chunk r of each block (``_sections``)
    pipeline stages          local ``decoder.layers.{i}`` is global layer ``layer_number - 1``
    tied output layer        the last stage's ``output_layer.weight`` copy is not in the full dict (a TP1/PP1
                             tied model has none); it is loaded from ``embedding.word_embeddings.weight``
    padded vocabulary        full dicts keep the padded rows; loading a dict with fewer vocab rows pads zeros,
                             with more (saved under a larger TP) drops the extra padding rows
    experts (MoE)            ``mlp.experts.local_experts.{j}`` of EP rank e is global expert ``e * n_local + j``;
                             expert linears are split over the expert-tensor-parallel group (not the TP group)

Both functions accept a wrapped model (DDP, Float16Module: anything with ``.module``) and are collective over
the TP group (all_gather) and the PP group (all_gather_object) when those are larger than 1, and over the
expert-tensor and expert-parallel groups for an MoE model.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl.distributed.bootstrap import ParallelGroups

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_TIED_COPY = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Local name -> parameter or buffer (with its partition attributes), without ``_extra_state`` entries."""
    return {
        name: tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if not name.endswith("_extra_state") and isinstance(tensor, torch.Tensor)
    }


def _global_name(model: torch.nn.Module, name: str, groups: ParallelGroups | None = None) -> str:
    match = _LAYER.match(name)
    if match is None:
        return name
    layer_number = model.decoder.layers[int(match[2])].layer_number  # 1-based, global across PP stages
    name = f"{match[1]}{layer_number - 1}.{match[3]}"
    expert = _LOCAL_EXPERT.match(name)
    if expert is None or groups is None or groups.ep_size == 1:
        return name
    per_rank = model.config.num_moe_experts // groups.ep_size
    return f"{expert[1]}{groups.ep_rank * per_rank + int(expert[2])}{expert[3]}"


def _is_expert(name: str) -> bool:
    return _LOCAL_EXPERT.match(name) is not None


def _tp_of(name: str, groups: ParallelGroups) -> tuple[int, int, object]:
    """(size, rank, group) of the tensor-parallel split of ``name``: the expert-TP group for experts."""
    if _is_expert(name):
        return groups.etp_size, groups.etp_rank, groups.etp_group
    return groups.tp_size, groups.tp_rank, groups.tp_group


def _is_gated_fc1(model: torch.nn.Module, name: str) -> bool:
    return model.config.gated_linear_unit and re.search(r"linear_fc1\.(weight|bias)$", name) is not None


def _sections(model: torch.nn.Module, name: str, local_rows: int) -> list[int] | None:
    """Row blocks of a TP shard that are split over TP one by one (module doc), as local sizes; None for a plain
    split. Gated fc1: ``[gate_r; up_r]``; Gated-DeltaNet (model/hybrid.py) ``in_proj``: ``[q_r; k_r; v_r; z_r;
    beta_r; alpha_r]`` and ``conv1d``: ``[q_r; k_r; v_r]`` (megatron's ``in_proj_split_sections``)."""
    if _is_gated_fc1(model, name):
        return [local_rows // 2] * 2
    match = re.match(r"^(.*self_attention)\.(in_proj|conv1d)\.(weight|bias)$", name)
    if match is None:
        return None
    gdn = model.get_submodule(match[1])
    if not hasattr(gdn, "in_proj_split_sections"):
        return None
    if match[2] == "in_proj":
        return list(gdn.in_proj_split_sections)
    return [gdn.qk_dim_local_tp, gdn.qk_dim_local_tp, gdn.v_dim_local_tp]


def _is_tied_copy(model: torch.nn.Module, name: str) -> bool:
    return name == _TIED_COPY and model.share_embeddings_and_output_weights


def _unshard_tp(shards: list[torch.Tensor], dim: int, sections: list[int] | None) -> torch.Tensor:
    if sections is None:
        return torch.cat(shards, dim=dim)
    blocks = [shard.split(sections, dim=dim) for shard in shards]  # [(gate_r, up_r)] for gated fc1
    return torch.cat([b[i] for i in range(len(sections)) for b in blocks], dim=dim)


def _shard_tp(full: torch.Tensor, local_shape: torch.Size, dim: int, sections: list[int] | None, tp: int,
              rank: int, vocab: bool = False):
    if sections is not None:
        blocks = full.split([n * tp for n in sections], dim=dim)  # (gate, up) for gated fc1
        return torch.cat([block.chunk(tp, dim=dim)[rank] for block in blocks], dim=dim)
    missing = local_shape[dim] * tp - full.shape[dim]
    if missing > 0:  # vocabulary padded to a multiple of tp
        pad_shape = list(full.shape)
        pad_shape[dim] = missing
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    elif missing < 0 and vocab:  # padding rows of a larger TP's vocabulary (never used by the logprobs)
        full = full.narrow(dim, 0, local_shape[dim] * tp)
    return full.chunk(tp, dim=dim)[rank]


def _gather_tp(tensor: torch.Tensor, size: int, group: object, dim: int, sections: list[int] | None
               ) -> torch.Tensor:
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return _unshard_tp(shards, dim, sections)


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, groups: ParallelGroups, *,
                    include: Callable[[str], bool] | None = None, all_stages: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's state dict, TP- and PP-unsharded, on CPU, on every rank (collective); only the tensors
    whose local name ``include`` accepts, when given (the same on every rank: e.g. the LoRA adapters);
    ``all_stages=False``: this pipeline stage's tensors only (global names; nothing crosses stages)."""
    model = unwrap(model)
    stage: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, tensor in _local_tensors(model).items():
        if _is_tied_copy(model, name) or (include is not None and not include(name)):
            continue
        value = tensor.detach()
        size, _, group = _tp_of(name, groups)
        if getattr(tensor, "tensor_model_parallel", False) and size > 1:
            value = _gather_tp(value, size, group, tensor.partition_dim,
                               _sections(model, name, tensor.shape[tensor.partition_dim]))
        (experts if _is_expert(name) else stage)[_global_name(model, name, groups)] = value.cpu().clone()
    if groups.ep_size > 1:  # each EP rank holds its own experts: gather them all
        parts: list[dict[str, torch.Tensor] | None] = [None] * groups.ep_size
        dist.all_gather_object(parts, experts, group=groups.ep_group)
        experts = {name: value for part in parts for name, value in part.items()}
    stage.update(experts)
    if groups.pp_size == 1 or not all_stages:
        return stage
    stages: list[dict[str, torch.Tensor] | None] = [None] * groups.pp_size
    dist.all_gather_object(stages, stage, group=groups.pp_group)
    return {name: value for part in stages for name, value in part.items()}


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full_sd: dict[str, torch.Tensor], groups: ParallelGroups, *,
                         optional: Callable[[str], bool] | None = None) -> None:
    """Copy this rank's shard of ``full_sd`` (a ``full_state_dict`` / TP1-PP1 state dict) into ``model``.

    KeyError naming the missing keys if ``full_sd`` lacks a tensor this stage needs (tensors whose name
    ``optional`` accepts may be absent: they keep their values); ValueError on a shape that does not match.
    """
    model = unwrap(model)
    local = _local_tensors(model)
    if optional is not None:
        local = {n: t for n, t in local.items() if not (optional(n) and _source_name(model, n, groups) not in full_sd)}
    missing = [n for n in local if _source_name(model, n, groups) not in full_sd]
    if missing:
        raise KeyError(f"load_full_state_dict: full state dict lacks {missing[:5]} ({len(missing)} missing)")
    for name, tensor in local.items():
        full = full_sd[_source_name(model, name, groups)].to(tensor.device, tensor.dtype)
        if getattr(tensor, "tensor_model_parallel", False):
            size, rank, _ = _tp_of(name, groups)
            full = _shard_tp(full, tensor.shape, tensor.partition_dim,
                             _sections(model, name, tensor.shape[tensor.partition_dim]),
                             size, rank, vocab=name in (_EMBEDDING, _TIED_COPY))
        if full.shape != tensor.shape:
            raise ValueError(
                f"load_full_state_dict: {name} needs shape {tuple(tensor.shape)} on this rank, the full state "
                f"dict gives {tuple(full.shape)}; build the model from the same ModelConfig"
            )
        tensor.data.copy_(full)


def _source_name(model: torch.nn.Module, name: str, groups: ParallelGroups) -> str:
    """Key of ``name``'s tensor in a full state dict (the tied output layer reads the embedding)."""
    if _is_tied_copy(model, name):
        return _EMBEDDING
    return _global_name(model, name, groups)
