"""LoRA checkpoints (docs/LORA.md section 3): the adapters are the model state, the frozen base is not saved; a
fingerprint of the base in the manifest makes resuming on another base one ValueError.

Called by ``checkpoint/dist.py``: ``model_sharded_state`` (what ``dist_checkpointing`` saves of a model chunk),
``load_model_state``, ``manifest_entries`` (at save; collective) and ``check_compatible`` (at load; collective).
The optimizer state needs nothing here: megatron's optimizer holds the adapters only, and its sharded state is
keyed through the model's sharded tensors (the adapters' ShardedTensors wrap the parameters themselves).

Adapter keys are global (``model.weights`` full-state-dict names: global layer numbers) and TP-split adapters
are ShardedTensors along their ``partition_dim``, so a LoRA checkpoint loads under any TP/PP/DP/CP layout.

Base fingerprint: per full base tensor, the float64 sum and sum of squares of its entries (TP shards summed over
the TP group, stages and expert ranks gathered), padding rows of the vocabulary left out. It does not depend on
the layout (beyond float64 rounding: compared at 1e-9 relative); a different base changes it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import MegatronRLConfig
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model.lora import adapter_parameters, is_adapter_name
from megatron_rl.model.weights import _global_name, _is_tied_copy, unwrap

FINGERPRINT_KEY = "lora_base_fingerprint"
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
_RTOL = 1e-9


def model_sharded_state(chunk: torch.nn.Module, groups: ParallelGroups) -> dict[str, Any]:
    """``{local name: ShardedTensor}`` of this chunk's adapters (global keys, TP-split along partition_dim)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    chunk = unwrap(chunk)
    state = {}
    for name, param in adapter_parameters(chunk):
        key = _global_name(chunk, name, groups)
        if getattr(param, "tensor_model_parallel", False):
            state[name] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=param.partition_dim)
        else:
            state[name] = make_sharded_tensor_for_checkpoint(param, key)
    return state


def load_model_state(chunk: torch.nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """Copy the loaded adapters into ``chunk``; every adapter must be there and nothing else."""
    result = unwrap(chunk).load_state_dict(loaded, strict=False)
    missing = [name for name in result.missing_keys if is_adapter_name(name)]
    assert not missing and not result.unexpected_keys, (missing[:3], result.unexpected_keys[:3])


def base_fingerprint(chunks: list[torch.nn.Module], groups: ParallelGroups, vocab_size: int) -> dict[str, list[float]]:
    """``{global name: [sum, sum of squares]}`` (float64) of every base tensor, the same on every rank
    (collective over TP, EP and PP)."""
    local: dict[str, torch.Tensor] = {}
    split: list[str] = []
    for chunk in chunks:
        chunk = unwrap(chunk)
        for name, param in chunk.named_parameters():
            if is_adapter_name(name) or _is_tied_copy(chunk, name):
                continue
            tensor = param.detach()
            if name in _VOCAB_ROWS and getattr(param, "tensor_model_parallel", False):
                rows = max(0, min(tensor.shape[0], vocab_size - groups.tp_rank * tensor.shape[0]))
                tensor = tensor[:rows]
            elif name in _VOCAB_ROWS:
                tensor = tensor[:vocab_size]
            key = _global_name(chunk, name, groups)
            local[key] = torch.stack([tensor.sum(dtype=torch.float64),
                                      torch.linalg.vector_norm(tensor, dtype=torch.float64) ** 2])
            if getattr(param, "tensor_model_parallel", False) and ".experts." not in name:  # experts: whole (etp 1)
                split.append(key)
    if split and groups.tp_size > 1:  # the same names in the same order on every TP rank
        sums = torch.stack([local[k] for k in split])  # on the parameters' device (NCCL needs it there)
        dist.all_reduce(sums, group=groups.tp_group)
        local.update(zip(split, sums))
    entries = {k: [float(v[0]), float(v[1])] for k, v in local.items()}
    for size, group in ((groups.ep_size, groups.ep_group), (groups.pp_size, groups.pp_group)):
        if size > 1:
            parts: list[dict | None] = [None] * size
            dist.all_gather_object(parts, entries, group=group)
            entries = {k: v for part in parts for k, v in part.items()}
    return entries


def manifest_entries(chunks: list[torch.nn.Module], config: MegatronRLConfig, groups: ParallelGroups) -> dict[str, Any]:
    """What a LoRA run adds to the manifest (nothing for a full fine-tune). Collective."""
    if not config.model.lora.enabled:
        return {}
    return {FINGERPRINT_KEY: base_fingerprint(chunks, groups, config.model.vocab_size)}


def check_compatible(manifest: dict, chunks: list[torch.nn.Module], config: MegatronRLConfig, groups: ParallelGroups,
                     ckpt: Path) -> None:
    """ValueError (on every rank) for full <-> LoRA, another rank / target modules, or another base. Collective."""
    saved = manifest["model"].get("lora") or {"rank": 0}
    lora = config.model.lora
    if (saved["rank"] > 0) != lora.enabled:
        held, this = ("LoRA adapters", "a full fine-tune") if saved["rank"] else ("a full fine-tune", "LoRA")
        raise ValueError(f"checkpoint {ckpt} holds {held} (model.lora.rank={saved['rank']}) but this run is {this} "
                         f"(model.lora.rank={lora.rank}); set model.lora.rank={saved['rank']} or start from another "
                         "checkpoint")
    if not lora.enabled:
        return
    for field in ("rank", "target_modules"):
        if saved.get(field) != getattr(lora, field):
            raise ValueError(f"checkpoint {ckpt} holds adapters with model.lora.{field}={saved.get(field)!r}, this "
                             f"run has {getattr(lora, field)!r}; set model.lora.{field} to the checkpoint's")
    current = base_fingerprint(chunks, groups, config.model.vocab_size)
    differ = [k for k, v in manifest.get(FINGERPRINT_KEY, {}).items()
              if k not in current or not all(math.isclose(a, b, rel_tol=_RTOL, abs_tol=1e-12)
                                              for a, b in zip(v, current[k]))]
    if differ or set(current) != set(manifest.get(FINGERPRINT_KEY, {})):
        raise ValueError(f"checkpoint {ckpt} holds adapters trained on another base model ({len(differ)} base "
                         f"tensors differ, e.g. {differ[:1]}); load the base it was trained on (model.hf_path)")
