"""A vision-language model (Qwen2.5-VL, Qwen3.5) on megatron-core: the vision tower beside our language GPTModel, images
riding in the packed THD batch, 3-D multimodal RoPE positions built per sequence (docs/VISION.md).

Place in the data flow: the "Megatron model" box of docs/DESIGN.md section 1 for a ``qwen2_5_vl`` checkpoint
(``hf/families/qwen2_5_vl.py`` loads and exports its weights) and for a ``qwen3_5`` one (``qwen35_vl.py``: the
language GPTModel is the hybrid Gated-DeltaNet one). Per micro-batch:

    rows [b, S] left-padded, responses right-aligned           (the layout of docs/DESIGN.md section 2)
    data.mrope.mrope_positions   -> [3, b, S]  per row, on its valid tokens only (padding never shifts them)
    data.packing.pack(rows)      -> PackedBatch [1, T] (padding removed)
    data.mrope.pack_positions    -> [3, T]     the same scatter as the tokens'
    VisionLanguageModel.forward  (first stage) embeddings [T, 1, H]; the vision tower runs ONCE over all images
                                 of the micro-batch; its outputs replace the image-token embeddings in pack
                                 order (= row order = image order); the language GPTModel (local spec) runs on
                                 them with RoPE cos/sin from ``MropeParams`` (per-token 3-D positions)

The vision tower is transformers' own (``AutoModel`` of the checkpoint's ``vision_config``: Qwen2.5-VL's
``Qwen2_5_VisionTransformerPretrainedModel``, Qwen3.5's ``Qwen3_5VisionModel``), replicated on every TP rank of
the first pipeline stage; plain torch, runs on CPU: mbridge 0.15.1's Megatron tower is TE-only with hard-coded
full-size shapes (docs/VISION.md section 1). Later pipeline stages hold no tower and get no pixels, only the
3-D positions (their attention's RoPE); the p2p messages are hidden states, as for a text model. Under
sequence parallelism the embedding stays whole until ``embed`` has replaced the image rows, then is scattered;
under context parallelism every CP rank runs the tower and keeps its own tokens' image rows
(``MropeParams.image_rows``; docs/VISION.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_rl.model.rotary import PackedRopeParams


@dataclass
class MropeParams(PackedRopeParams):
    """``PackedRopeParams`` whose ``position_ids`` are 3-D: ``[3, T]`` (temporal, height, width) per token.

    Qwen2-VL's multimodal RoPE: the rotary half-dimension ``D/2`` is split into ``mrope_section`` (e.g. [16, 24,
    24]); section i takes its angles from position row ``i % 3``; text tokens carry equal rows (plain RoPE).
    ``mrope_interleaved`` (Qwen3-VL, Qwen3.5): the sections interleave instead (``mrope_rows``)."""

    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    pixel_values: torch.Tensor | None = None
    """``[N, F]`` the micro-batch's image patches (row order) when they ride with the pack (``data/mrope.py:
    VisionPack``); the model's ``pixel_values`` argument otherwise."""
    image_grid_thw: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    """``[T]`` bool: the tokens the images replace (``data/mrope.py: images_tokens``); None: every image token."""
    image_rows: torch.Tensor | None = None
    """Context parallelism: ``[n]`` int64, the tower's output row of each image token of this rank
    (``data/mrope.py: VisionCPLocalPack``); None: all rows, in order."""

    def rope_cos_sin(self, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(table), dtype)
        if key not in self.rope_cache:
            half = table.shape[-1] // 2  # table [S, 1, 1, D] = cat(freqs, freqs): angles pos * inv_freq
            if sum(self.mrope_section) != half:
                raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to half the rotary dim ({half})")
            rows = torch.stack([table[self.position_ids[k]][..., :half] for k in range(3)])  # [3, T, 1, 1, D/2]
            pick = mrope_rows(self.mrope_section, self.mrope_interleaved).to(rows.device)  # [D/2]: row per freq
            freqs = rows.gather(0, pick.expand(rows.shape[1:])[None])[0]  # [T, 1, 1, D/2]
            freqs = torch.cat((freqs, freqs), dim=-1)  # [T, 1, 1, D]
            self.rope_cache[key] = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        return self.rope_cache[key]


def mrope_rows(section: tuple[int, ...] | list[int], interleaved: bool) -> torch.Tensor:
    """``[sum(section)]`` int64: the position row (0 T, 1 H, 2 W) each rotary frequency takes its angle from.

    Consecutive sections (Qwen2-VL, Qwen2.5-VL): section i -> row ``i % 3``, e.g. [2, 3, 3] -> T T H H H W W W.
    Interleaved (Qwen3-VL, Qwen3.5; transformers' ``recomposition_frequencies``): frequency j -> H when
    ``j % 3 == 1 and j < 3 * section[1]``, W when ``j % 3 == 2 and j < 3 * section[2]``, else T; e.g. [3, 3, 2] ->
    T H W T H W T H."""
    if not interleaved:
        return torch.cat([torch.full((width,), i % 3) for i, width in enumerate(section)]).long()
    j = torch.arange(sum(section))
    rows = torch.zeros_like(j)
    for row in (1, 2):
        rows[(j % 3 == row) & (j < 3 * section[row])] = row
    return rows


def mrope_params(packed: Any, positions: torch.Tensor, mrope_section: list[int] | tuple[int, ...],
                 mrope_interleaved: bool = False, **images: Any) -> MropeParams:
    """``MropeParams`` for a pack and its 3-D positions ``[3, T]`` (``data/mrope.py: pack_positions``);
    ``images``: ``pixel_values``, ``image_grid_thw`` riding with it."""
    return MropeParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                       max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen, position_ids=positions,
                       mrope_section=tuple(mrope_section), mrope_interleaved=mrope_interleaved, **images)


class VisionLanguageModel(MegatronModule):
    """``language_model`` (our GPTModel stage) and, on the first pipeline stage, ``visual`` (the vision tower).
    A ``MegatronModule``: its default ``sharded_state_dict`` (distributed checkpoints) takes the language model's
    and saves the tower's tensors as replicated over TP and DP.

    ``forward(input_ids, position_ids, attention_mask, packed_seq_params=MropeParams, pixel_values=..., image_
    grid_thw=...)``: ``pixel_values [patches, C*tp*p*p]`` of every image of the micro-batch, in row order."""

    def __init__(self, language_model: torch.nn.Module, visual: torch.nn.Module | None, image_token_id: int,
                 freeze_vision: bool = False) -> None:
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.visual = visual
        self.image_token_id = image_token_id
        self.freeze_vision = freeze_vision
        """``model.freeze_vision``: the tower's parameters do not require a gradient (so megatron-core's DDP and
        optimizer leave them out: no grad buffer, no Adam state, not in the grad norm) and the weight sync skips
        them (``hf/families/qwen2_5_vl.py: VisionStageStream``); its state dict (export, checkpoint) keeps them."""
        if freeze_vision and visual is not None:
            visual.requires_grad_(False)
        # what megatron-core's schedule, DDP and grad finalization read from a model chunk
        self.model_type = language_model.model_type
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights

    @property
    def decoder(self) -> torch.nn.Module:
        """The language model's decoder (``model/weights.py`` numbers layers by it); a property, not a second
        registration of the module."""
        return self.language_model.decoder

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        return self.language_model.shared_embedding_or_output_weight()

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
              image_grid_thw: torch.Tensor | None, image_mask: torch.Tensor | None = None,
              image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[S, b, H]`` token embeddings with each image token's row (``image_mask [b*S]`` of them, when given)
        replaced by the vision tower's output; under sequence parallelism then scattered (``[S/tp, b, H]``: the
        embedding is built unscattered, ``build_vision_language_model``), so that the tower sees every image
        row's gradient on every TP rank (the scatter's backward all-gathers it)."""
        embeds = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [S, b, H]
        is_image = input_ids == self.image_token_id if image_mask is None else image_mask.view(input_ids.shape)
        is_image = is_image.transpose(0, 1)  # [S, b]
        if pixel_values is None:
            if bool(is_image.any()):
                raise ValueError("image tokens in the batch but no pixel_values")
        else:
            image = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
            image = getattr(image, "pooler_output", image)  # transformers 5: an output object; 4.x: the tensor
            if image_rows is not None:  # context parallelism: this rank's image tokens' rows
                image = image[image_rows]
            if int(is_image.sum()) != image.shape[0]:
                raise ValueError(f"{int(is_image.sum())} image tokens but the vision tower gave {image.shape[0]} "
                                 "embeddings (image_grid_thw does not match the image placeholders)")
            embeds = embeds.masked_scatter(is_image[..., None], image.to(embeds.dtype))
        if self.config.sequence_parallel:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            embeds = scatter_to_sequence_parallel_region(embeds, group=self.language_model.embedding.tp_group).clone()
        return embeds

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: Any, *,
                packed_seq_params: Any = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        image_mask = image_rows = None
        if pixel_values is None and isinstance(packed_seq_params, MropeParams):  # images riding with the pack
            pixel_values, image_grid_thw = packed_seq_params.pixel_values, packed_seq_params.image_grid_thw
            image_mask, image_rows = packed_seq_params.image_mask, packed_seq_params.image_rows
        decoder_input = None
        if self.visual is not None and self.language_model.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask, image_rows)
        return self.language_model(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   packed_seq_params=packed_seq_params, **kwargs)


def build_vision_language_model(model_cfg: Any, parallel_cfg: Any, groups: Any, hf_config: Any) -> VisionLanguageModel:
    """This rank's stage of a vision-language model: ``model/builder.py``'s GPTModel for the language model, and
    the vision tower (transformers' ``AutoModel`` of ``hf_config.vision_config``, ``model_cfg.params_dtype``) on
    the first stage (frozen with ``model.freeze_vision``)."""
    from transformers import AutoModel

    from megatron_rl.model.builder import _DTYPES, build_gpt_model

    language = build_gpt_model(model_cfg, parallel_cfg, groups, scatter_embedding=False)  # embed() scatters
    visual = None
    if groups.is_first_stage:
        visual = AutoModel.from_config(hf_config.vision_config, dtype=_DTYPES[model_cfg.params_dtype]).to(groups.device)
    return VisionLanguageModel(language, visual, image_token_id=hf_config.image_token_id,
                               freeze_vision=bool(getattr(model_cfg, "freeze_vision", False)))
