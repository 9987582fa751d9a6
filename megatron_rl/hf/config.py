"""Hugging Face ``config.json`` -> megatron_rl ``ModelConfig`` (Llama, Qwen2, Qwen3; MoE: Qwen3-MoE, Mixtral;
hybrid Gated-DeltaNet: Qwen3.5 text and the language model of multimodal Qwen3.5, ``hf/qwen35.py``).

Place in the data flow: set-up, before the model is built (``model.builder.build_gpt_model`` reads the
returned ``ModelConfig``); ``hf/weights.py`` then fills the built model with the checkpoint's tensors.

Mapping (docs/HF.md section 2):

    num_hidden_layers -> num_layers            intermediate_size -> ffn_hidden_size
    num_key_value_heads -> num_query_groups     head_dim -> kv_channels (else hidden_size // heads)
    rope theta -> rotary_base                   rms_norm_eps -> layernorm_epsilon
    tie_word_embeddings -> share_embeddings_and_output_weights
    qwen2 -> add_qkv_bias=True                  qwen3, qwen3_moe -> qk_layernorm=True

Mixture-of-experts (docs/HF.md section 7; every layer must be an MoE layer):

    num_experts (qwen3_moe) / num_local_experts (mixtral) -> num_moe_experts
    moe_intermediate_size (qwen3_moe) / intermediate_size (mixtral) -> moe_ffn_hidden_size
    num_experts_per_tok -> moe_router_topk       softmax scores
    norm_topk_prob (qwen3_moe; mixtral: always True) -> moe_router_pre_softmax = not norm_topk_prob

Features the Megatron model here cannot reproduce (RoPE scaling, sliding windows, biases outside q/k/v, an
activation other than SiLU) raise ValueError instead of loading a silently different model. Only local
directories are read (no downloads).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from megatron_rl.config import ModelConfig
from megatron_rl.hf import qwen35

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", *qwen35.MODEL_TYPES)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


HF_DIR_KEY = "hf_dir"
"""How errors name the checkpoint directory by default: the ``hf_dir`` argument of the ``megatron_rl.hf``
functions. Callers that read it from the config pass ``key="model.hf_path"``, so the message names what the
user set."""


def load_hf_config(hf_dir: str | os.PathLike, *, key: str = HF_DIR_KEY) -> Any:
    """The ``transformers`` config of a local checkpoint directory; ValueError (naming ``key``) for a missing
    directory, a missing config.json or an unsupported ``model_type``."""
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{key}={str(hf_dir)!r} has no config.json; point it at a local Hugging Face checkpoint "
            "directory (config.json + *.safetensors + tokenizer files)"
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(
            f"{key}={str(hf_dir)!r}: config.json cannot be read as a supported architecture ({err}); "
            f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from err
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{key}={str(hf_dir)!r} has model_type={hf_config.model_type!r} "
            f"(architectures={getattr(hf_config, 'architectures', None)}); supported model_type values: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return hf_config


def rope_theta(hf_config: Any) -> float:
    """RoPE base: transformers 5 keeps it in ``rope_parameters``, 4.x in ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    assert theta is not None, "transformers config without a RoPE theta"
    return float(theta)


def _reject_unsupported(hf_config: Any, where: str) -> None:
    """ValueError for HF features our GPTModel would silently compute differently."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = getattr(hf_config, "rope_scaling", None)
    problems = []
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        problems.append(f"RoPE scaling rope_type={rope_type!r} (only 'default' is supported)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (only 'silu' SwiGLU is supported)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (MLP biases are not supported)")
    if hf_config.model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (it adds an o_proj bias; only Qwen2-style q/k/v biases are supported)")
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (sliding-window attention is not supported)")
    if hf_config.model_type == "mixtral" and getattr(hf_config, "sliding_window", None) is not None:
        problems.append(f"sliding_window={hf_config.sliding_window} (sliding-window attention is not supported)")
    if hf_config.model_type == "qwen3_moe":
        if getattr(hf_config, "decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={hf_config.decoder_sparse_step} (every layer must be an MoE "
                            "layer: decoder_sparse_step=1)")
        if getattr(hf_config, "mlp_only_layers", None):
            problems.append(f"mlp_only_layers={list(hf_config.mlp_only_layers)} (dense layers among MoE layers are "
                            "not supported: mlp_only_layers=[])")
    if problems:
        raise ValueError(f"{where}: unsupported model features: {'; '.join(problems)}")


def model_config_from_hf(hf_dir: str | os.PathLike, base: ModelConfig | None = None, *,
                         key: str = HF_DIR_KEY) -> ModelConfig:
    """``ModelConfig`` with every shape field taken from ``hf_dir/config.json`` and ``hf_path=hf_dir``.

    Fields that are not part of the checkpoint (``params_dtype``, ``attention_backend``, ``init_method_std``)
    come from ``base`` (defaults when None).
    """
    hf_config = load_hf_config(hf_dir, key=key)
    where = f"{key}={str(hf_dir)!r} ({hf_config.model_type})"
    text = qwen35.text_config(hf_config)  # the language model of a multimodal Qwen3.5 (hf/qwen35.py)
    _reject_unsupported(text, where)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return dataclasses.replace(
        base or ModelConfig(),
        hf_path=str(hf_dir),
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        ffn_hidden_size=text.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(text, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
        rotary_base=rope_theta(text),
        layernorm_epsilon=text.rms_norm_eps,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe", *qwen35.MODEL_TYPES),
        **_moe_fields(hf_config),
        **_hybrid_fields(hf_config, where),
    )


def _hybrid_fields(hf_config: Any, where: str) -> dict[str, Any]:
    """Qwen3.5's Gated-DeltaNet and gated-attention fields (hf/qwen35.py); plain values for other types."""
    if hf_config.model_type not in qwen35.MODEL_TYPES:
        return {"linear_attention_freq": None, "attention_output_gate": False, "rotary_percent": 1.0,
                "layernorm_zero_centered_gamma": False}
    try:
        return qwen35.model_fields(hf_config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    """The ``ModelConfig`` MoE fields of a Qwen3-MoE or Mixtral config (no experts for a dense one).

    HF's router: softmax over all experts, top-k, then (``norm_topk_prob``; Mixtral always) divide by the sum of
    the k. megatron-core's ``moe_router_pre_softmax=True`` is softmax-then-top-k without renormalization;
    ``False`` is top-k of the logits, then a softmax over the k, which equals the renormalized top-k of the full
    softmax (softmax is monotonic and the shared normalizer cancels; tests/hf/test_hf_moe.py compares both with
    transformers). The load-balancing settings are training choices, not checkpoint facts: they stay ``base``'s.
    """
    if hf_config.model_type == "qwen3_moe":
        experts, ffn, renormalize = hf_config.num_experts, hf_config.moe_intermediate_size, hf_config.norm_topk_prob
    elif hf_config.model_type == "mixtral":
        experts, ffn, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
    else:  # a dense checkpoint: no experts even if ``base`` had some
        return {"num_moe_experts": None, "moe_ffn_hidden_size": None}
    return {"num_moe_experts": experts, "moe_ffn_hidden_size": ffn, "moe_router_topk": hf_config.num_experts_per_tok,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": not renormalize}


def checkpoint_dtype(hf_config: Any) -> str:
    """The dtype ``config.json`` declares (transformers 5 ``dtype``, 4.x ``torch_dtype``), or 'unset'."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "unset"


def describe_hf_load(hf_dir: str | os.PathLike, model_cfg: ModelConfig, pad_id: int, pad_source: str) -> str:
    """One line with every value a load takes from the checkpoint's config.json and tokenizer (printed once)."""
    hf_config = load_hf_config(hf_dir)
    return (
        f"megatron_rl.hf: {str(hf_dir)} ({hf_config.model_type}): vocab {model_cfg.vocab_size}, "
        f"pad id {pad_id} ({pad_source}), dtype {model_cfg.params_dtype} (model.params_dtype; checkpoint "
        f"{checkpoint_dtype(hf_config)}), tied embeddings {model_cfg.share_embeddings_and_output_weights}, "
        f"{model_cfg.num_layers} layers x hidden {model_cfg.hidden_size}"
        + (f", {model_cfg.num_moe_experts} experts top-{model_cfg.moe_router_topk} (pre_softmax "
           f"{model_cfg.moe_router_pre_softmax})" if model_cfg.num_moe_experts is not None else "")
    )


def hf_config_for(model_cfg: ModelConfig) -> Any:
    """A ``transformers`` config for a model built from ``model_cfg`` (no checkpoint of its own: e.g. trained
    from scratch), so that HF export and an inference engine can load it: Qwen3 when ``qk_layernorm``, Qwen2
    when ``add_qkv_bias``, else Llama; with ``num_moe_experts``, Qwen3-MoE (``qk_layernorm``) or Mixtral.
    ``model_config_from_hf`` of the result gives back every shape field."""
    from transformers import AutoConfig

    if model_cfg.qk_layernorm and model_cfg.add_qkv_bias:
        raise ValueError("no supported HF architecture has both qk_layernorm and add_qkv_bias")
    if model_cfg.num_moe_experts is not None:
        model_type, extra = _moe_hf_fields(model_cfg)
    else:
        model_type = "qwen3" if model_cfg.qk_layernorm else "qwen2" if model_cfg.add_qkv_bias else "llama"
        extra = {"intermediate_size": model_cfg.ffn_hidden_size}
    head_dim = model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads
    if model_type != "qwen2":
        extra["attention_bias"] = False
    return AutoConfig.for_model(
        model_type, hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers, num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups, head_dim=head_dim, vocab_size=model_cfg.vocab_size,
        max_position_embeddings=model_cfg.max_position_embeddings, rms_norm_eps=model_cfg.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rotary_base},
        tie_word_embeddings=model_cfg.share_embeddings_and_output_weights, hidden_act="silu",
        dtype=model_cfg.params_dtype, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )  # fmt: skip


def _moe_hf_fields(model_cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(model_type, MoE config kwargs) of an MoE ``model_cfg``: Qwen3-MoE when it has q/k norms, else Mixtral
    (no q/k norms, renormalized top-k); ValueError naming the field for a router no HF architecture has."""
    ffn = model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
    if model_cfg.moe_router_score_function != "softmax":
        raise ValueError(f"model.moe_router_score_function={model_cfg.moe_router_score_function!r} has no HF "
                         "architecture here (Qwen3-MoE and Mixtral use softmax); set it to 'softmax'")
    if model_cfg.add_qkv_bias:
        raise ValueError("model.add_qkv_bias=True with num_moe_experts: no supported HF MoE architecture has q/k/v "
                         "biases; set add_qkv_bias=false")
    common = {"num_experts_per_tok": model_cfg.moe_router_topk, "router_aux_loss_coef": model_cfg.moe_aux_loss_coeff}
    if model_cfg.qk_layernorm:
        return "qwen3_moe", {**common, "num_experts": model_cfg.num_moe_experts, "moe_intermediate_size": ffn,
                             "intermediate_size": model_cfg.ffn_hidden_size, "decoder_sparse_step": 1,
                             "mlp_only_layers": [], "norm_topk_prob": not model_cfg.moe_router_pre_softmax}
    if model_cfg.moe_router_pre_softmax:
        raise ValueError("model.moe_router_pre_softmax=True without qk_layernorm: Mixtral (the HF MoE architecture "
                         "without q/k norms) renormalizes the top-k; set moe_router_pre_softmax=false or "
                         "qk_layernorm=true (Qwen3-MoE with norm_topk_prob=false)")
    return "mixtral", {**common, "num_local_experts": model_cfg.num_moe_experts, "intermediate_size": ffn,
                       "sliding_window": None}


def write_hf_config(model_cfg: ModelConfig, out_dir: str | os.PathLike) -> Path:
    """Write ``hf_config_for(model_cfg)`` as ``out_dir/config.json`` (atomically); returns ``out_dir``."""
    from megatron_rl.atomic import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", hf_config_for(model_cfg).to_json_string())
    return out
