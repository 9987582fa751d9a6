"""What a model family is: the HF ``model_type``s it reads, its config mapping, its weight import/export and
what it supports (``Family``, ``Support``). The families themselves are the sibling modules; the registry that
finds one is ``hf/families/__init__.py``.

Place in the data flow: set-up (``hf/config.py: model_config_from_hf`` asks the checkpoint's family for its
``ModelConfig`` fields; ``hf/weights.py`` for its weights) and the rollout engines (``Support``: what the
model can do there). Nothing outside ``hf/families`` asks which ``model_type`` a checkpoint has: it asks its
family (``families.family_of(model_cfg)``) what it needs.

A family's heavy code (torch, mbridge, transformers) is imported inside its methods: the registry is read by the
job's config checks, before any rank starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator


def rope_theta(hf_config: Any) -> float:
    """RoPE base: transformers 5 keeps it in ``rope_parameters``, 4.x in ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    assert theta is not None, "transformers config without a RoPE theta"
    return float(theta)


@dataclass(frozen=True)
class Support:
    """What a family's models can do beyond training with the built-in engine (the defaults: a plain
    transformer)."""

    kv_cache_decoding: bool = True
    """The built-in engine decodes with a KV cache (``inference/builtin_engine.py``); False: it recomputes the
    whole sequence per token (a Gated-DeltaNet layer's state is not a KV cache)."""
    vllm_prefix_caching: bool = True
    """vLLM's ``--enable-prefix-caching`` is right for it (W45: not for hybrid models, docs/MEGATRON_CORE.md)."""
    vllm_cpu_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """Engine dtypes vLLM's CPU kernels run it in; the first is the one ``rollout.dtype=auto`` picks when the
    policy's ``params_dtype`` is not among them (``inference/config.py: engine_dtype``)."""
    vllm_cpu_dtype_why: str = ""
    """The start-up line's reason when ``rollout.dtype=auto`` picks ``vllm_cpu_dtypes[0]`` over the policy's
    dtype ('' = a generic phrase)."""
    vllm_cpu_linear_head_dims: tuple[int, ...] | None = None
    """Gated-DeltaNet head dims vLLM's CPU kernels accept (``linear_key_head_dim``, ``linear_value_head_dim``);
    None: the family has no such layers."""
    vllm_adapter_sync: bool = True
    """A LoRA policy's vLLM engines get the adapters only (``hf/weights.py: iter_hf_weights(merge_adapters=
    False)``); False: refused (``model.lora.rank > 0`` with ``rollout.engine=vllm``)."""
    vllm_images: bool = False
    """Its prompts may carry images: the vLLM engines load the checkpoint's tokenizer and image processor and
    take token prompts with images (``inference/vllm/server.py: ServeOptions.images``; docs/VISION.md)."""


@dataclass(frozen=True)
class Family:
    """One model family. Subclasses override what differs (``dense.py`` is the mbridge path every other family
    starts from); ``register_family`` makes one known (``hf/families/__init__.py``)."""

    name: str
    """What ``model.family`` says once resolved (e.g. 'dense')."""
    model_types: tuple[str, ...]
    """The HF ``config.json`` ``model_type`` values it reads."""
    support: Support = field(default_factory=Support)
    title: str = ""
    """How messages name its models (e.g. 'hybrid Gated-DeltaNet (Qwen3.5)'); '' = ``name``."""

    # --- config: HF config -> ModelConfig fields (hf/config.py adds the fields every family shares) -----------

    def text_config(self, hf_config: Any) -> Any:
        """The config of the language model (the whole config unless it is nested, e.g. a multimodal one)."""
        return hf_config

    def problems(self, hf_config: Any) -> list[str]:
        """Features of ``hf_config`` this family's model here would compute differently (each a phrase naming
        the field; ``hf/config.py`` adds the ones no family supports); by default, an o_proj bias."""
        if getattr(self.text_config(hf_config), "attention_bias", False):
            return ["attention_bias=True (it adds an o_proj bias; only Qwen2-style q/k/v biases are supported)"]
        return []

    def model_fields(self, hf_config: Any) -> dict[str, Any]:
        """The ``ModelConfig`` fields this family sets beyond the shared shapes (``hf/config.py``); ValueError
        (one line) for a config it cannot map."""
        return {}

    def builds(self, model_cfg: Any) -> bool:
        """Whether a ``ModelConfig`` without ``hf_path`` (trained from scratch) is this family's model; only
        the built-in families answer (a family of your own is named by ``model.family``)."""
        return False

    def hf_config_kwargs(self, model_cfg: Any) -> tuple[str, dict[str, Any]]:
        """``(model_type, extra AutoConfig.for_model kwargs)`` for a model of this family that has no checkpoint
        of its own (``hf/config.py: hf_config_for``); ValueError naming the field when none fits."""
        raise ValueError(f"model family {self.name!r} writes no HF config for a model trained from scratch; "
                         "set model.hf_path to a checkpoint of it")

    def policy_class(self) -> type | None:
        """The ``MegatronPolicy`` subclass its models train with (``hf/weights.py: policy_from_hf``); None:
        ``MegatronPolicy`` itself."""
        return None

    # --- weights (collective: run on every rank) -----------------------------------------------------------

    def load_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> None:
        """Copy ``hf_dir``'s safetensors into this rank's bare model chunks."""
        raise NotImplementedError

    def iter_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        """``(hf_name, full tensor on CPU)`` of every HF weight (export; ``hf/weights.py: iter_hf_weights``)."""
        raise NotImplementedError

    def stage_stream(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> Any:
        """The converter ``hf/weights.py: iter_stage_hf_weights`` streams one pipeline stage with (built once per
        engine): an mbridge bridge, or an object with ``iter_stage_weights(model_chunks, groups)``."""
        raise NotImplementedError
