"""Hugging Face checkpoints in and out: config -> ModelConfig (``config.py``), tokenizer and pad id
(``tokenizer.py``), safetensors <-> Megatron weights under any TP/PP/EP layout (``weights.py``, via mbridge;
MoE: Qwen3-MoE and Mixtral, docs/HF.md section 7).

Typical use (every rank):

    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir)       # shapes from config.json, pad id from the
                                                              # tokenizer, weights (+ optimizer main copies);
                                                              # rank 0 prints the values it took, one line
    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir, pad_token_id=0)   # a folder without tokenizer files
    ...
    export_policy_to_hf(policy, out_dir)                      # rank 0 writes; transformers loads out_dir
"""

from megatron_rl.hf.config import SUPPORTED_MODEL_TYPES, model_config_from_hf
from megatron_rl.hf.tokenizer import load_tokenizer, pad_token_id, resolve_pad_token_id
from megatron_rl.hf.weights import (
    export_hf,
    export_policy_to_hf,
    load_hf_into_policy,
    load_hf_weights,
    policy_from_hf,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES", "export_hf", "export_policy_to_hf", "load_hf_into_policy", "load_hf_weights",
    "load_tokenizer", "model_config_from_hf", "pad_token_id", "policy_from_hf", "resolve_pad_token_id",
]  # fmt: skip
