"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL / Qwen3.5, "mrope"): 3-D (temporal, height, width) positions per
token, built per sequence and carried through padding removal (docs/VISION.md section 3).

Place in the data flow: per micro-batch, beside ``data/packing.py: pack`` (pure tensor code, no Megatron):

    row i (left-padded; valid tokens only)   t t t <v s> I I I I <v e> t t | response r r r
    text token at text position p           (p, p, p); the next text token p + 1
    image of t x h x w merged patches        (p + ti, p + hi, p + wi) for its token (ti, hi, wi) in raster order;
    starting at text position p              the text after it starts at p + max(h, w) (transformers'
                                             ``Qwen2_5_VLModel.get_rope_index`` for images; Qwen3.5's
                                             ``get_vision_position_ids`` gives the same for images)
    mrope_positions   [3, b, S]   per row on its valid tokens (left padding never shifts them; a response is
                                  the row's trailing text, so it continues the prompt's positions)
    pack_positions    [3, T]      each valid token's positions where ``pack`` put the token

The model side (``model/vision_language.py: MropeParams``) turns ``[3, T]`` into per-token RoPE cos/sin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.data.packing import CPLocalPack, PackedBatch, cu_seq_starts


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Language-model tokens of each image: ``t * h * w / merge**2`` (its patches after the 2x2 merge)."""
    return [int(n) for n in (image_grid_thw.prod(-1) // spatial_merge_size**2).tolist()]


def _row_positions(tokens: list[int], grids: list[list[int]], image_token_id: int, merge: int) -> torch.Tensor:
    """``[3, n]`` positions of one sequence's valid tokens (transformers' ``Qwen2_5_VLModel.get_rope_index``):
    text advances all three rows by one; an image of ``t x h x w`` merged patches starting at text position p
    takes (p + t_i, p + h_i, p + w_i) and the next text starts at p + max(h, w)."""
    out, pos, j, images = [], 0, 0, iter(grids)
    while j < len(tokens):
        if tokens[j] != image_token_id:
            out.append(torch.full((3, 1), pos, dtype=torch.long))
            pos, j = pos + 1, j + 1
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError("more image tokens than images (image_grid_thw) in a sequence")
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos, j = pos + max(h, w), j + t * h * w
    if next(images, None) is not None:
        raise ValueError("fewer image tokens than images (image_grid_thw) in a sequence")
    return torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)


def mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    *, image_token_id: int, spatial_merge_size: int) -> torch.Tensor:
    """``[3, b, S]`` int64 3-D positions of left-padded rows ``input_ids [b, S]``; padding gets 0. Images are
    taken from ``image_grid_thw [n, 3]`` (patches, before the merge) in row order, as they appear."""
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    counts = image_token_counts(image_grid_thw, spatial_merge_size) if grids else []
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    used = 0
    for i in range(input_ids.shape[0]):
        valid = attention_mask[i].bool().cpu()
        tokens = input_ids[i].cpu()[valid].tolist()
        n_image_tokens = sum(1 for tok in tokens if tok == image_token_id)
        mine, total = [], 0
        while total < n_image_tokens and used < len(grids):
            mine.append(grids[used])
            total, used = total + counts[used], used + 1
        if total != n_image_tokens:
            raise ValueError(f"row {i}: {n_image_tokens} image tokens, but the images of image_grid_thw give "
                             f"{total}; each image needs t*h*w/{spatial_merge_size**2} image tokens")
        out[:, i, valid] = _row_positions(tokens, mine, image_token_id, spatial_merge_size)
    if used != len(grids):
        raise ValueError(f"{len(grids) - used} images of image_grid_thw have no image tokens in the rows")
    return out.to(input_ids.device)


def pack_positions(positions: torch.Tensor, attention_mask: torch.Tensor, packed: Any) -> torch.Tensor:
    """``[3, b, S]`` row positions -> ``[3, T]`` for ``packed = data.packing.pack(input_ids, attention_mask)``:
    each valid token's 3-D position lands where ``pack`` put the token; alignment padding and a dummy sequence
    keep the pack's 1-D positions (their outputs are never read)."""
    valid = attention_mask.bool()
    seq_lens = valid.sum(dim=1)  # [b]
    row = torch.repeat_interleave(torch.arange(len(seq_lens), device=valid.device), seq_lens)  # [N]
    offset = torch.arange(int(seq_lens.sum()), device=valid.device) - cu_seq_starts(seq_lens)[row]
    dest = packed.cu_seqlens[:-1].to(valid.device, torch.int64)[row] + offset  # as data.packing.pack
    out = packed.position_ids.reshape(1, -1).expand(positions.shape[0], -1).clone()
    out[:, dest] = positions[:, valid].to(out.device)
    return out


def row_images(pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A batch's per-row images -> the vision tower's input. Right-aligned like every per-row tensor of a
    ``TrainingBatch`` (so ``TrainingBatch.concat``'s left padding keeps them valid): ``pixel_values [b, P, F]``
    (each row's patches last, zero rows before) and ``image_grid_thw [b, K, 3]`` (each row's images last,
    all-zero rows before) -> ``(pixels [N, F], grids [n, 3])`` in row order, or ``(None, None)`` without images;
    ``pixels`` is None when ``pixel_values`` is (a later pipeline stage: the grids alone place the positions)."""
    if image_grid_thw is None:
        return None, None
    pixels, grids = [], []
    for i in range(image_grid_thw.shape[0]):
        mine = image_grid_thw[i][image_grid_thw[i].prod(-1) > 0]  # [k, 3]
        if len(mine):
            grids.append(mine)
            if pixel_values is not None:
                pixels.append(pixel_values[i, pixel_values.shape[1] - int(mine.prod(-1).sum()):])
    if not grids:
        return None, None
    return (torch.cat(pixels) if pixels else None), torch.cat(grids)


def batch_images(rows: list[list[tuple[torch.Tensor, tuple[int, int, int]]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row images ``[[(pixels [n, F], (t, h, w)), ...], ...]`` -> the batch tensors ``row_images`` reads:
    ``pixel_values [B, P, F]`` float, ``image_grid_thw [B, K, 3]`` int64, right-aligned (a row may have none)."""
    features = next((p.shape[1] for row in rows for p, _ in row), 1)
    width = max([sum(p.shape[0] for p, _ in row) for row in rows] + [1])
    count = max([len(row) for row in rows] + [1])
    pixel_values = torch.zeros(len(rows), width, features)
    image_grid_thw = torch.zeros(len(rows), count, 3, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            patches = torch.cat([p for p, _ in row])
            pixel_values[i, width - patches.shape[0]:] = patches
            image_grid_thw[i, count - len(row):] = torch.tensor([list(g) for _, g in row])
    return pixel_values, image_grid_thw


@dataclass
class VisionPack(PackedBatch):
    """A ``PackedBatch`` of a vision-language model: its 3-D positions and images ride with it to the model
    (``packed_seq_params`` gives ``model/vision_language.py: MropeParams``)."""

    mrope_positions: torch.Tensor | None = None
    """``[3, T]`` int64 (``pack_positions``)."""
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    """The sections interleave (Qwen3.5; ``model/vision_language.py: mrope_rows``)."""
    pixel_values: torch.Tensor | None = None
    """``[N, F]`` every patch of the micro-batch's images, row order (``row_images``); None: no image."""
    image_grid_thw: torch.Tensor | None = None
    """``[n, 3]`` int64 their patch grids."""
    image_mask: torch.Tensor | None = None
    """``[T]`` bool: the pack's tokens that the images' embeddings replace (``images_tokens``)."""

    def packed_seq_params(self) -> Any:
        from megatron_rl.model.vision_language import mrope_params

        return mrope_params(self, self.mrope_positions, self.mrope_section, self.mrope_interleaved,
                            pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                            image_mask=self.image_mask)


@dataclass
class VisionCPLocalPack(CPLocalPack):
    """Context parallelism: a CP rank's part of a ``VisionPack`` (``vision_cp_local``): its tokens' 3-D positions
    and image mask, and the row of the tower's output (all the micro-batch's images, pack order: the tower runs on
    every CP rank) that each of its image tokens takes."""

    mrope_positions: torch.Tensor | None = None
    """``[3, T/cp]`` int64: this rank's tokens' (``cp_index[cp_rank]``)."""
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    """``[T/cp]`` bool: this rank's tokens that an image's embedding replaces."""
    image_rows: torch.Tensor | None = None
    """``[n]`` int64: for each of them (local order), its row of the tower's output."""

    def packed_seq_params(self) -> Any:
        from megatron_rl.model.vision_language import mrope_params

        params = mrope_params(self, self.mrope_positions, self.mrope_section, self.mrope_interleaved,
                              pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                              image_mask=self.image_mask, image_rows=self.image_rows)
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = self.cu_seqlens  # as CPLocalPack's
        params.cp_order = self.cp_order
        return params


def vision_cp_local(local: CPLocalPack, whole: VisionPack) -> VisionCPLocalPack:
    """``local`` (``split_for_cp`` of ``whole``'s pack) with its share of ``whole``'s positions and images."""
    mine = local.cp_index[local.cp_rank]  # [T/cp] global pack positions of this rank's tokens
    rows = whole.image_mask.long().cumsum(0) - 1  # [T] the tower's output row of each image token
    image_mask = whole.image_mask[mine]
    fields = {f.name: getattr(local, f.name) for f in dataclasses.fields(CPLocalPack)}
    return VisionCPLocalPack(**fields, mrope_positions=whole.mrope_positions[:, mine],
                             mrope_section=whole.mrope_section, mrope_interleaved=whole.mrope_interleaved,
                             pixel_values=whole.pixel_values, image_grid_thw=whole.image_grid_thw,
                             image_mask=image_mask, image_rows=rows[mine][image_mask])


def vision_pack(packed: PackedBatch, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                spatial_merge_size: int, mrope_section: list[int], mrope_interleaved: bool = False) -> VisionPack:
    """``packed`` (= ``pack(input_ids, attention_mask)``) with the rows' 3-D positions and images."""
    pixels, grids = row_images(pixel_values, image_grid_thw)
    mine = images_tokens(input_ids, attention_mask, image_grid_thw, image_token_id, spatial_merge_size)
    rows = mrope_positions(input_ids.masked_fill((input_ids == image_token_id) & ~mine, -1), attention_mask, grids,
                           image_token_id=image_token_id, spatial_merge_size=spatial_merge_size)
    image_mask = pack_positions(mine[None].long(), attention_mask, packed)[0] == 1  # padding slots: their position
    image_mask &= packed.input_ids[0] == image_token_id  # ... but pad tokens
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(PackedBatch)}
    return VisionPack(**fields, mrope_positions=pack_positions(rows, attention_mask, packed),
                      mrope_section=tuple(mrope_section), mrope_interleaved=mrope_interleaved, pixel_values=pixels,
                      image_grid_thw=grids, image_mask=image_mask)


def images_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                  image_token_id: int, spatial_merge_size: int) -> torch.Tensor:
    """``[b, S]`` bool: the image tokens that are the rows' images' (``image_grid_thw [b, K, 3]``: each row's
    first t*h*w/merge**2 per image, in order). An image token past them (a response may sample one) is text, as
    in transformers' and vLLM's generation: text positions, its own embedding."""
    is_image = (input_ids == image_token_id) & attention_mask.bool()
    if image_grid_thw is None:
        return torch.zeros_like(is_image)
    counts = (image_grid_thw.prod(-1) // spatial_merge_size**2).sum(-1).to(input_ids.device)  # [b]
    return is_image & (is_image.long().cumsum(1) <= counts[:, None])
