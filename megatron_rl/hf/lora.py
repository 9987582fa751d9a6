"""LoRA adapters out as a ``peft`` adapter (docs/LORA.md section 4): ``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's ``LoRARequest`` load.

Place in the data flow: export (``hf/weights.py`` ``export_policy_to_hf`` writes it into ``<export>/adapter/``
beside the merged model; the merged model itself comes from ``iter_hf_weights`` with the adapters merged in).
One adapter per HF module, as the trainer keeps them (``model/lora.py``): unsharding is a plain concatenation
(``model.weights.full_state_dict``), the names are peft's (``lora.peft_name``), nothing is re-fit or split.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import LoraConfig
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model.lora import is_adapter_name, peft_name
from megatron_rl.model.weights import full_state_dict

ADAPTER_DIR = "adapter"
"""Sub-directory of an HF export holding the peft adapter (not the export's top level: transformers would take an
``adapter_config.json`` there for an adapter to load onto ``base_model_name_or_path``)."""


def adapter_config(lora: LoraConfig, base_model: str | None) -> dict:
    """peft's ``adapter_config.json`` for ``lora`` (bias none, no dropout: as trained)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.scale * lora.rank, "target_modules": sorted(lora.target_modules),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }  # fmt: skip


def peft_adapter_tensors(module: torch.nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """``{peft name: full tensor (CPU)}`` of every adapter, on every rank (collective over TP and PP)."""
    full = full_state_dict(module, groups, include=is_adapter_name)
    return {peft_name(name): tensor.contiguous() for name, tensor in full.items()}


def export_peft_adapter(module: torch.nn.Module, lora: LoraConfig, out_dir: str | os.PathLike, groups: ParallelGroups,
                        base_model: str | None = None) -> Path:
    """Write the adapters as a peft adapter directory (rank 0 writes, under a temporary name then renamed;
    collective). Returns ``out_dir``."""
    from safetensors.torch import save_file

    tensors = peft_adapter_tensors(module, groups)
    out_dir = Path(out_dir)
    if dist.get_rank() == 0:
        tmp = out_dir.with_name(f".tmp.{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(lora, base_model), indent=1))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier()
    return out_dir
