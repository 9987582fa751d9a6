"""Qwen2.5-VL, the vision-language family (docs/VISION.md): its language model is a Qwen2 (q/k/v biases) that
mbridge's ``qwen2`` bridge converts; its vision tower (``visual.*``) is transformers' own module inside
``model/vision_language.py: VisionLanguageModel``, loaded and exported by name, unchanged.

Checkpoint layout read (``Qwen2_5_VLForConditionalGeneration.save_pretrained``, transformers 4.5x and 5.x, and
the published checkpoints): ``model.embed_tokens``, ``model.layers.*``, ``model.norm``, ``lm_head`` (absent when
tied) and ``visual.*``; the text fields are nested under ``text_config`` in transformers 5 (top level in 4.x:
``text_config`` then mirrors them).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from megatron_rl.hf.families.base import Support
from megatron_rl.hf.families.dense import DenseFamily

MODEL_TYPE = "qwen2_5_vl"
VISION_PREFIXES = ("visual.", "model.visual.")
"""Where checkpoints keep the vision tower: the published layout, and transformers 5's in-memory names."""


def language_chunks(model_chunks: list) -> list:
    """The language GPTModel of each (possibly wrapped) ``VisionLanguageModel`` chunk (a GPTModel as it is)."""
    from megatron_rl.model.weights import unwrap

    return [getattr(unwrap(chunk), "language_model", unwrap(chunk)) for chunk in model_chunks]


def load_vision_tower(model_chunks: list, hf_dir: str | os.PathLike) -> None:
    """Each chunk's vision tower (the first stage's) from ``hf_dir``'s ``visual.*`` tensors, strictly."""
    from megatron_rl.model.weights import unwrap

    _, state = vision_state(hf_dir)
    for chunk in model_chunks:
        visual = unwrap(chunk).visual
        if visual is not None:
            visual.load_state_dict(state, strict=True)


def tower_state(model_chunks: list, groups: Any) -> dict[str, Any]:
    """The vision tower's tensors (names without prefix) on CPU, on every rank: the first pipeline stage holds the
    tower (``model/vision_language.py``); under PP it is broadcast over the PP group (collective there), so that
    the export yields every weight on every rank as the language model's does."""
    import torch.distributed as dist

    from megatron_rl.model.weights import unwrap

    visual = getattr(unwrap(model_chunks[0]), "visual", None)
    state = None if visual is None else {name: tensor.detach().to("cpu", copy=True).contiguous()
                                         for name, tensor in visual.state_dict().items()}
    if groups.pp_size > 1:
        box = [state]
        dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp_group, 0), group=groups.pp_group)
        state = box[0]
    return state


def vision_state(hf_dir: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """``(prefix, {name without prefix: tensor})`` of the vision tower's tensors in ``hf_dir``'s safetensors."""
    from safetensors import safe_open

    found: dict[str, dict[str, Any]] = {prefix: {} for prefix in VISION_PREFIXES}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    found[prefix][name[len(prefix):]] = f.get_tensor(name)
    prefix = max(found, key=lambda p: len(found[p]))
    if not found[prefix]:
        raise ValueError(f"{str(hf_dir)!r}: a qwen2_5_vl checkpoint without vision weights ({' or '.join(VISION_PREFIXES)}*)")
    return prefix, found[prefix]


@dataclass(frozen=True)
class Qwen25VLFamily(DenseFamily):
    """The language model through mbridge's ``qwen2`` bridge (seen as the text config), the tower by name."""

    def text_config(self, hf_config: Any) -> Any:
        return getattr(hf_config, "text_config", None) or hf_config

    def problems(self, hf_config: Any) -> list[str]:
        text = self.text_config(hf_config)
        section = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if section is None or 2 * sum(section) != head_dim:
            return [f"rope_parameters.mrope_section={section} (it must sum to head_dim/2 = {head_dim // 2})"]
        return []

    def builds(self, model_cfg: Any) -> bool:
        return False  # only from a checkpoint (model.hf_path): a ModelConfig has no vision tower

    def hf_config_kwargs(self, model_cfg: Any) -> tuple[str, dict[str, Any]]:
        raise ValueError("model family 'qwen2_5_vl' writes no HF config for a model trained from scratch; set "
                         "model.hf_path to a Qwen2.5-VL checkpoint")

    def policy_class(self) -> type:
        from megatron_rl.model.vision_policy import VisionLanguagePolicy

        return VisionLanguagePolicy

    def bridge_config(self, hf_config: Any) -> Any:
        """The text config as mbridge's ``qwen2`` bridge reads it (tied embeddings from the top level)."""
        text = copy.deepcopy(self.text_config(hf_config))
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        return text

    def load_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> None:
        super().load_weights(language_chunks(model_chunks), hf_dir, groups, model_cfg, hf_config)
        load_vision_tower(model_chunks, hf_dir)

    def iter_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        yield from super().iter_weights(language_chunks(model_chunks), hf_dir, groups, model_cfg, hf_config,
                                        merge_adapters)
        prefix, _ = vision_state(hf_dir)
        for name, tensor in tower_state(model_chunks, groups).items():
            yield prefix + name, tensor

    def stage_stream(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> Any:
        from megatron_rl.hf.mbridge import stage_bridge

        return VisionStageStream(stage_bridge(language_chunks(model_chunks), self.bridge_config(hf_config), groups,
                                              bridge_type="qwen2", grouped_experts=False))


@dataclass(frozen=True)
class VisionStageStream:
    """The weight sync's stream of a stage (``hf/weights.py: iter_stage_hf_weights``): the language model's
    tensors through mbridge's ``qwen2`` bridge (``language``, given ``language_chunks``; Qwen3.5: its own
    ``hf/qwen35.py: StageStream``), then, on the first stage's stream root, the vision tower's as ``visual.*``
    (``vision_prefix``: the published layout, which vLLM's Qwen2.5-VL loads),
    unchanged (``extra_stage_weights``). Loading and exporting a checkpoint (``DenseFamily.load_weights`` /
    ``iter_weights``, given the language chunks) go to the language bridge; the family moves the tower itself."""

    language: Any
    vision_prefix: str = VISION_PREFIXES[0]
    """The tower's tensor names' prefix (Qwen3.5: ``model.visual.``, its checkpoints' layout)."""

    @staticmethod
    def language_chunks(model_chunks: list) -> list:
        return language_chunks(model_chunks)

    def extra_stage_weights(self, model_chunks: list, groups: Any) -> Iterator[tuple[str, Any]]:
        """The tower's tensors on the stream root; none when it is frozen (``model.freeze_vision``): the engines
        keep the tower they started on (the policy's export at start), which a frozen tower still equals."""
        from megatron_rl.model.weights import unwrap

        model = unwrap(model_chunks[0])
        visual = getattr(model, "visual", None)  # the first stage's; None on the later ones
        if getattr(model, "freeze_vision", False):
            return
        if visual is not None and groups.tp_rank == 0 and groups.ep_rank == 0:  # the stream root
            for name, tensor in visual.state_dict().items():
                yield self.vision_prefix + name, tensor.detach()

    def load_weights(self, views: list, hf_dir: str) -> None:
        self.language.load_weights(views, hf_dir)

    def export_weights(self, views: list) -> Iterator[tuple[str, Any]]:
        return self.language.export_weights(views)


QWEN2_5_VL = Qwen25VLFamily(
    name="qwen2_5_vl", model_types=(MODEL_TYPE,), title="vision-language (Qwen2.5-VL)",
    types={MODEL_TYPE: {"add_qkv_bias": True}}, bridges={MODEL_TYPE: "qwen2"},
    support=Support(vllm_adapter_sync=False, vllm_images=True),
)
"""Qwen2.5-VL. Training and log-probs (``model/vision_language.py``); the built-in engine decodes it with the KV
cache (3-D positions: ``model/kv_cache.py``); vLLM serves it with images
(``inference/vllm/images.py``, the weight sync streams the tower: docs/VISION.md section 9); the main job generates
with images on the built-in engine or the vLLM fleet (sections 8-9)."""
