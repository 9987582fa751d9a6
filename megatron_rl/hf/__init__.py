"""Hugging Face checkpoints in and out: config -> ModelConfig (``config.py``), tokenizer and pad id
(``tokenizer.py``), safetensors <-> Megatron weights under any TP/PP/EP layout (``weights.py``, via mbridge;
MoE: Qwen3-MoE and Mixtral, docs/HF.md section 7), one model family per ``model_type`` group (``families/``:
``register_family`` adds one of yours, docs/HF.md section 8).

Typical use (every rank):

    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir)       # shapes from config.json, pad id from the
                                                              # tokenizer, weights (+ optimizer main copies);
                                                              # rank 0 prints the values it took, one line
    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir, pad_token_id=0)   # a folder without tokenizer files
    ...
    export_policy_to_hf(policy, out_dir)                      # rank 0 writes; transformers loads out_dir

The names below are imported when first used (PEP 562): ``megatron_rl.hf.families`` and ``hf.config`` are read
by the job's config checks, which must not pay for megatron-core (``weights.py``).
"""

import importlib
from typing import Any

_HOMES = {
    "model_config_from_hf": "config", "register_family": "families", "supported_model_types": "families",
    "load_tokenizer": "tokenizer", "pad_token_id": "tokenizer", "resolve_pad_token_id": "tokenizer",
    **dict.fromkeys(("export_hf", "export_policy_to_hf", "load_hf_into_policy", "load_hf_weights", "policy_from_hf"),
                    "weights"),
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'megatron_rl.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatron_rl.hf.{_HOMES[name]}"), name)
