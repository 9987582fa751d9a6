"""``VisionLanguagePolicy``: a ``MegatronPolicy`` whose model sees images (Qwen2.5-VL, Qwen3.5; docs/VISION.md).

Place in the data flow: the policy of docs/DESIGN.md section 1, for a ``model.hf_path`` of a vision-language
checkpoint. What differs from the text policy, and nothing else:

    build_module     model/vision_language.py: VisionLanguageModel (language GPTModel + the vision tower)
    plan_call        each micro-batch's pack becomes a data/mrope.py: VisionPack (3-D positions built per row,
                     the rows' images in row order), so megatron's schedule hands them to the model through
                     ``packed_seq_params`` like any pack; under PP every stage builds the 3-D positions (each
                     stage's attention applies RoPE), the first stage alone keeps the pixels (its tower's input);
                     under CP each rank keeps its tokens' share (data/mrope.py: VisionCPLocalPack)

Batch keys beside the standard ones (docs/INTERFACES.md): ``pixel_values [B, P, F]`` float (each row's image
patches, right-aligned: zero rows first) and ``image_grid_thw [B, K, 3]`` int64 (each row's images, right-aligned;
all-zero rows = none), as ``data/mrope.py: batch_images`` builds them; a batch without them is text only.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.data.mrope import vision_cp_local, vision_pack
from megatron_rl.model.plan import CallPlan
from megatron_rl.model.policy import MegatronPolicy
from megatron_rl.model.vision_language import build_vision_language_model

IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def load_vl_config(hf_path: str | None) -> Any:
    """The transformers config of the checkpoint (its ``vision_config``, image token and ``mrope_section``)."""
    from transformers import AutoConfig

    if hf_path is None:
        raise ValueError("a vision-language policy needs model.hf_path (its vision tower's shapes and image token "
                         "come from the checkpoint's config.json); set it to a Qwen2.5-VL checkpoint")
    return AutoConfig.from_pretrained(hf_path, local_files_only=True)


class VisionLanguagePolicy(MegatronPolicy):
    """``MegatronPolicy`` over a ``VisionLanguageModel`` (module docstring)."""

    def build_module(self) -> torch.nn.Module:
        self.vl_config = load_vl_config(self.config.model.hf_path)
        return build_vision_language_model(self.config.model, self.config.parallel, self.groups, self.vl_config)

    def plan_call(self, batch: TrainingBatch, **kwargs: Any) -> CallPlan:
        present = [key for key in IMAGE_KEYS if key in batch]
        if len(present) == 1:
            raise ValueError(f"batch has {present[0]!r} but not {[k for k in IMAGE_KEYS if k not in present][0]!r}; "
                             "pass both (data/mrope.py: batch_images) or neither")
        if "pixel_values" in batch and not self.groups.is_first_stage:  # the tower is the first stage's only
            batch = TrainingBatch({k: v for k, v in batch.tensors.items() if k != "pixel_values"}, batch.uids,
                                  batch.trajectory_ids, batch.is_last_step)
        call = super().plan_call(batch, **kwargs)
        rope = self.vl_config.text_config.rope_parameters
        for item in call.microbatches:
            item.packed = vision_pack(
                item.packed, item.tensors["sequences"], item.tensors["attention_mask"],
                item.tensors.get("pixel_values"), item.tensors.get("image_grid_thw"),
                image_token_id=self.vl_config.image_token_id,
                spatial_merge_size=self.vl_config.vision_config.spatial_merge_size,
                mrope_section=rope["mrope_section"], mrope_interleaved=bool(rope.get("mrope_interleaved", False)))
            if item.cp_local is not None:  # context parallelism: this rank's tokens' positions and image rows
                item.cp_local = vision_cp_local(item.cp_local, item.packed)
        return call
