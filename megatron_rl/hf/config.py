"""Hugging Face ``config.json`` -> megatron_rl ``ModelConfig``, through the checkpoint's model family
(``hf/families``: Llama, Qwen2, Qwen3; MoE: Qwen3-MoE, Mixtral; hybrid Gated-DeltaNet: Qwen3.5; or one of yours).

Place in the data flow: set-up, before the model is built (``model.builder.build_gpt_model`` reads the
returned ``ModelConfig``); ``hf/weights.py`` then fills the built model with the checkpoint's tensors. The main
job resolves its model section once, at load (``job/config.py: load_job_config``), and every consumer reads it
there; ``config.json`` itself is read once per process (``load_hf_config`` keeps it, keyed by path and mtime).

Mapping shared by every family (docs/HF.md section 2); the family adds its own fields (``Family.model_fields``):

    num_hidden_layers -> num_layers            intermediate_size -> ffn_hidden_size
    num_key_value_heads -> num_query_groups     head_dim -> kv_channels (else hidden_size // heads)
    rope theta -> rotary_base                   rms_norm_eps -> layernorm_epsilon
    tie_word_embeddings -> share_embeddings_and_output_weights
    the family's name -> family                 (qwen2: add_qkv_bias; qwen3, qwen3_moe, qwen3.5: qk_layernorm)

Features the Megatron model here cannot reproduce (RoPE scaling, sliding windows, biases outside q/k/v, an
activation other than SiLU) raise ValueError instead of loading a silently different model. Only local
directories are read (no downloads).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

from megatron_rl.config import ModelConfig
from megatron_rl.hf import families
from megatron_rl.hf.families.base import rope_theta

HF_DIR_KEY = "hf_dir"
"""How errors name the checkpoint directory by default: the ``hf_dir`` argument of the ``megatron_rl.hf``
functions. Callers that read it from the config pass ``key="model.hf_path"``, so the message names what the
user set."""

_CONFIGS: dict[tuple[str, int], Any] = {}
"""``load_hf_config``'s reads: (config.json's resolved path, its mtime in ns) -> the transformers config."""


def configs_read() -> int:
    """``config.json`` files this process has parsed (one per checkpoint; tests count them)."""
    return len(_CONFIGS)


def config_json(hf_dir: str | os.PathLike, *, key: str = HF_DIR_KEY) -> Path:
    """``hf_dir/config.json``; ValueError (naming ``key``) when it is not there."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{key}={str(hf_dir)!r} has no config.json; point it at a local Hugging Face checkpoint "
            "directory (config.json + *.safetensors + tokenizer files)"
        )
    return path


def load_hf_config(hf_dir: str | os.PathLike, *, key: str = HF_DIR_KEY) -> Any:
    """The ``transformers`` config of a local checkpoint directory (a copy of the one read once per process:
    callers may set attributes on it); ValueError (naming ``key``) for a missing directory, a missing
    config.json or a ``model_type`` no registered family reads (``hf/families``)."""
    path = config_json(hf_dir, key=key)
    cache_key = (str(path.resolve()), path.stat().st_mtime_ns)
    if cache_key not in _CONFIGS:
        _CONFIGS[cache_key] = _read(path.parent, hf_dir, key)
    hf_config = _CONFIGS[cache_key]
    if families.family_for_type(hf_config.model_type) is None:
        raise ValueError(
            f"{key}={str(hf_dir)!r} has model_type={hf_config.model_type!r} "
            f"(architectures={getattr(hf_config, 'architectures', None)}); supported model_type values: "
            f"{', '.join(families.supported_model_types())} (a family of your own: model.family, docs/HF.md)"
        )
    return copy.deepcopy(hf_config)


def _read(path: Path, hf_dir: str | os.PathLike, key: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(
            f"{key}={str(hf_dir)!r}: config.json cannot be read as a supported architecture ({err}); "
            f"supported model_type values: {', '.join(families.supported_model_types())} (a family of your own: "
            "model.family, docs/HF.md)"
        ) from err


def family_of_checkpoint(hf_config: Any) -> families.Family:
    """The family that reads ``hf_config`` (one ``load_hf_config`` returned: its type is registered)."""
    family = families.family_for_type(hf_config.model_type)
    assert family is not None, hf_config.model_type
    return family


def _reject_unsupported(hf_config: Any, family: families.Family, where: str) -> None:
    """ValueError for HF features our GPTModel would silently compute differently (the family adds its own)."""
    text = family.text_config(hf_config)
    params = getattr(text, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = getattr(text, "rope_scaling", None)
    problems = []
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        problems.append(f"RoPE scaling rope_type={rope_type!r} (only 'default' is supported)")
    if getattr(text, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={text.hidden_act!r} (only 'silu' SwiGLU is supported)")
    if getattr(text, "mlp_bias", False):
        problems.append("mlp_bias=True (MLP biases are not supported)")
    if getattr(text, "use_sliding_window", False):
        problems.append("use_sliding_window=True (sliding-window attention is not supported)")
    problems += family.problems(hf_config)
    if problems:
        raise ValueError(f"{where}: unsupported model features: {'; '.join(problems)}")


PLAIN_FIELDS = {"add_qkv_bias": False, "qk_layernorm": False, "num_moe_experts": None, "moe_ffn_hidden_size": None,
                "linear_attention_freq": None, "attention_output_gate": False, "rotary_percent": 1.0,
                "layernorm_zero_centered_gamma": False}
"""The family-specific fields of a plain dense transformer; a family's ``model_fields`` overrides them (whatever
``base`` had: a checkpoint's model has no experts unless its config.json says so)."""


def model_config_from_hf(hf_dir: str | os.PathLike, base: ModelConfig | None = None, *,
                         key: str = HF_DIR_KEY) -> ModelConfig:
    """``ModelConfig`` with every shape field taken from ``hf_dir/config.json``, ``hf_path=hf_dir`` and
    ``family`` the checkpoint's family (``base.family`` when it names one of your own: that family is
    registered first, ``hf/families``; ValueError when it does not read the checkpoint's ``model_type``).

    Fields that are not part of the checkpoint (``params_dtype``, ``attention_backend``, ``init_method_std``)
    come from ``base`` (defaults when None).
    """
    base = base or ModelConfig()
    named = families.load_family(base.family) if base.family else None  # registers a family of your own
    hf_config = load_hf_config(hf_dir, key=key)
    family = family_of_checkpoint(hf_config)
    where = f"{key}={str(hf_dir)!r} ({hf_config.model_type})"
    if named is not None and named is not family:
        raise ValueError(f"{where}: model.family={base.family!r} reads model_type {list(named.model_types)}, not "
                         f"{hf_config.model_type!r} (family {family.name!r}); unset model.family")
    _reject_unsupported(hf_config, family, where)
    if getattr(base, "freeze_vision", False) and getattr(hf_config, "vision_config", None) is None:
        raise ValueError(f"model.freeze_vision=true but {where} has no vision tower (a text-only checkpoint); set "
                         "model.freeze_vision=false, or point model.hf_path at a vision-language checkpoint")
    text = family.text_config(hf_config)  # e.g. the language model of a multimodal Qwen3.5
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    try:
        own = {**PLAIN_FIELDS, **family.model_fields(hf_config)}
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return dataclasses.replace(
        base,
        hf_path=str(hf_dir),
        family=base.family or family.name,
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
        **own,
    )


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
    from scratch), so that HF export and an inference engine can load it: the type its family writes
    (``Family.hf_config_kwargs``: Qwen3 when ``qk_layernorm``, Qwen2 when ``add_qkv_bias``, else Llama; with
    ``num_moe_experts``, Qwen3-MoE (``qk_layernorm``) or Mixtral). ``model_config_from_hf`` of the result gives
    back every shape field."""
    from transformers import AutoConfig

    if model_cfg.qk_layernorm and model_cfg.add_qkv_bias:
        raise ValueError("no supported HF architecture has both qk_layernorm and add_qkv_bias")
    model_type, extra = families.family_of(model_cfg).hf_config_kwargs(model_cfg)
    head_dim = model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads
    return AutoConfig.for_model(
        model_type, hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers, num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups, head_dim=head_dim, vocab_size=model_cfg.vocab_size,
        max_position_embeddings=model_cfg.max_position_embeddings, rms_norm_eps=model_cfg.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rotary_base},
        tie_word_embeddings=model_cfg.share_embeddings_and_output_weights, hidden_act="silu",
        dtype=model_cfg.params_dtype, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )  # fmt: skip


def write_hf_config(model_cfg: ModelConfig, out_dir: str | os.PathLike) -> Path:
    """Write ``hf_config_for(model_cfg)`` as ``out_dir/config.json`` (atomically); returns ``out_dir``."""
    from megatron_rl.atomic import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", hf_config_for(model_cfg).to_json_string())
    return out
