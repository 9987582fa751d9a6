"""The Qwen3.5 multimodal family (docs/VISION.md section 12): the published ``Qwen3_5ForConditionalGeneration``
layout (``model_type`` qwen3_5) trained whole: its hybrid Gated-DeltaNet language model through ``hf/qwen35.py``
(``model.language_model.*``, ``lm_head``), its vision tower (``model.visual.*``, transformers' ``Qwen3_5VisionModel``)
inside ``model/vision_language.py: VisionLanguageModel``, loaded and exported by name, unchanged; the text-only
layout (``qwen3_5_text``) stays ``qwen35.py``'s.

What differs from Qwen2.5-VL (``qwen2_5_vl.py``), read from transformers 5.24's ``modeling_qwen3_5.py``:

    language model      hybrid GDN + gated attention (hf/qwen35.py), RoPE on ``partial_rotary_factor`` of each
                        head: ``mrope_section`` sums to a quarter of the head (published: [11, 11, 10] of 64)
    multimodal RoPE     interleaved: frequency j takes its angle from H when j % 3 == 1 and j < 3 * section[1],
                        from W when j % 3 == 2 and j < 3 * section[2], else from T (``Qwen3_5TextRotaryEmbedding.
                        recomposition_frequencies``; the published configs say ``mrope_interleaved: true``)
    3-D positions       an image's as Qwen2.5-VL's (``get_vision_position_ids``: (p + t, p + h, p + w), the text
                        after it at p + max(h, w)): ``data/mrope.py`` unchanged
    vision tower        learned position grid resampled per image, 2-D RoPE, no windows, merger; no deepstack
                        (``Qwen3_5VisionModel`` returns the merged patches only; Qwen3-VL has deepstack, not this)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

from megatron_rl.hf.families.base import Support
from megatron_rl.hf.families.qwen2_5_vl import VisionStageStream, language_chunks, load_vision_tower, tower_state
from megatron_rl.hf.families.qwen35 import MULTIMODAL_MODEL_TYPE, PREFIXES, Qwen35Family

VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class Qwen35VLFamily(Qwen35Family):
    """``Qwen35Family``'s language model, given the ``VisionLanguageModel``'s language chunks, and the tower by
    name (``model.visual.*``)."""

    def text_config(self, hf_config: Any) -> Any:
        return hf_config.text_config

    def problems(self, hf_config: Any) -> list[str]:
        text = self.text_config(hf_config)
        params = getattr(text, "rope_parameters", None) or {}
        section = params.get("mrope_section")
        rotary = int((getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
                     * params.get("partial_rotary_factor", 1.0))
        problems = []
        if section is None or 2 * sum(section) != rotary:
            problems.append(f"rope_parameters.mrope_section={section} (it must sum to half the rotary dim, "
                            f"{rotary // 2})")
        if not params.get("mrope_interleaved"):
            problems.append("rope_parameters.mrope_interleaved is not true (transformers' Qwen3.5 interleaves the "
                            "sections whatever it says; the published checkpoints set it: add "
                            "\"mrope_interleaved\": true)")
        return problems

    def model_fields(self, hf_config: Any) -> dict[str, Any]:
        from megatron_rl.hf import qwen35

        return {"qk_layernorm": True, **qwen35.model_fields(self.text_config(hf_config), multimodal=True)}

    def builds(self, model_cfg: Any) -> bool:
        return False  # only from a checkpoint (model.hf_path): a ModelConfig has no vision tower

    def policy_class(self) -> type:
        from megatron_rl.model.vision_policy import VisionLanguagePolicy

        return VisionLanguagePolicy

    def load_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> None:
        super().load_weights(language_chunks(model_chunks), hf_dir, groups, model_cfg, hf_config)
        load_vision_tower(model_chunks, hf_dir)

    def iter_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        """The language model's tensors and the source's others but its tower (MTP layers: unchanged), then the
        trained tower's."""
        for name, tensor in super().iter_weights(language_chunks(model_chunks), hf_dir, groups, model_cfg,
                                                 hf_config, merge_adapters):
            if not name.startswith(VISION_PREFIX):
                yield name, tensor
        for name, tensor in tower_state(model_chunks, groups).items():  # the first stage's, on every rank
            yield VISION_PREFIX + name, tensor

    def stage_stream(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> Any:
        from megatron_rl.hf import qwen35

        return VisionStageStream(qwen35.StageStream(model_cfg, PREFIXES[MULTIMODAL_MODEL_TYPE]),
                                 vision_prefix=VISION_PREFIX)


QWEN35_VL = Qwen35VLFamily(
    name="qwen35_vl", model_types=(MULTIMODAL_MODEL_TYPE,), title="vision-language hybrid Gated-DeltaNet (Qwen3.5)",
    support=Support(kv_cache_decoding=False, vllm_prefix_caching=False, vllm_cpu_dtypes=("bfloat16",),
                    vllm_cpu_dtype_why="vLLM's CPU Gated-DeltaNet kernels run in bf16 only",
                    vllm_cpu_linear_head_dims=(64, 128), vllm_adapter_sync=False, vllm_images=True),
)
"""Qwen3.5 with its vision tower. Training, log-probs and the built-in engine with images (full forwards, as every
hybrid model); vLLM serves it with images (bf16 on CPU, as every Qwen3.5; the weight sync streams the tower as
``model.visual.*``: docs/VISION.md section 12)."""
