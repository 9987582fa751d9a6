"""Images in the turns of a multi-turn conversation (step API, agent; docs/VISION.md section 14).

Place in the data flow: ``conversation.py: Conversation`` encodes the text each turn adds, with the images that
text's placeholders stand for, through ``TurnImages.encode``; the images of every turn's whole context ride with
its prompt to the engine and into its training row (``GeneratorOutput['images']``)::

    image references     data.image_key's column (the first prompt, step API), reset() / step() returns (step
                         API), an agent's ``image_url`` content parts: a PIL image, a path, bytes, a data: URL
      read               -> RGB PIL images (``data/images.py: read_image``; ImageError naming the file)
      encode             the checkpoint's image processor; each image placeholder of the text becomes the image's
                         t*h*w/merge**2 image tokens (``ImageEncoder.expand``), then the tokenizer
      -> token ids of the text + ``RowImages`` ((pixels [n, F], (t, h, w)) per image, and PNG data URLs)

An image's placeholder is the checkpoint's image token between its vision start and end
(``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2.5-VL and Qwen3.5): ``placeholder``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.images import ImageEncoder, image_refs, read_image
from megatron_rl.environments.single_turn.images import RowImages, png_url

NO_IMAGES = ("images need a vision-language model.hf_path (Qwen2.5-VL, Qwen3.5) served by rollout.engine=builtin "
             "or vllm (docs/VISION.md section 14)")
"""Why a conversation without an image encoder refuses images."""


def joined(first: RowImages, second: RowImages) -> RowImages:
    """The images of ``first`` then ``second`` (patches and URLs)."""
    out = RowImages([*first, *second])
    out.urls = (*first.urls, *second.urls)
    return out


class TurnImages:
    """The checkpoint's image encoder for the turns of multi-turn conversations."""

    def __init__(self, encoder: ImageEncoder, image_token_id: int, placeholder: str,
                 base_dirs: Sequence[str | Path] = (".",), image_key: str | None = None) -> None:
        """``base_dirs``: where a relative image path is looked for, in order. ``image_key``: the data column
        holding each row's first images (``data.image_key``; None: none)."""
        self.encoder, self.image_token_id, self.placeholder = encoder, image_token_id, placeholder
        self.base_dirs, self.image_key = [Path(d) for d in base_dirs], image_key

    @classmethod
    def from_checkpoint(cls, hf_path: str | Path, base_dirs: Sequence[str | Path] = (".",),
                        image_key: str | None = None, encoder: ImageEncoder | None = None) -> TurnImages:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(hf_path, local_files_only=True)
        encoder = encoder or ImageEncoder.from_checkpoint(hf_path)
        names = [encoder.tokenizer.convert_ids_to_tokens(i) for i in (
            getattr(config, "vision_start_token_id", None), config.image_token_id,
            getattr(config, "vision_end_token_id", None)) if i is not None]
        return cls(encoder, int(config.image_token_id), "".join(names), base_dirs, image_key)

    def image_tokens(self, images: RowImages) -> int:
        """The image tokens ``images`` take in a prompt: t*h*w/merge**2 each."""
        return sum(t * h * w for _, (t, h, w) in images) // self.encoder.merge_size**2

    def row_images(self, row: dict[str, Any]) -> list[Any]:
        """The references of a data row's images (``image_key``'s column; none without it)."""
        return image_refs(dict(row), self.image_key) if self.image_key else []

    def read(self, refs: Sequence[Any]) -> list[Any]:
        """RGB PIL images of ``refs``; ``ImageError`` naming the first that cannot be read."""
        return [read_image(self._resolve(ref), self.base_dirs[0]) for ref in refs]

    def _resolve(self, ref: Any) -> Any:
        """A relative path found under one of ``base_dirs`` as that file's path; anything else as is."""
        if isinstance(ref, str) and not ref.startswith("data:") and len(ref) < 4096:
            found = next((d / ref for d in self.base_dirs if (d / ref).is_file()), None)
            return str(found) if found is not None else ref
        return ref

    def encode(self, tokenizer: Any, text: str, refs: Sequence[Any], *, add_special_tokens: bool
               ) -> tuple[list[int], RowImages]:
        """The token ids of ``text`` (one ``placeholder`` per image of ``refs``, in order) with each image's
        tokens, and its images; ``ImageError`` for an image that cannot be read or a placeholder count that does
        not match."""
        images = self.read(refs)
        expanded, pixels, grids = self.encoder.expand(text, images)
        ids = list(tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"])
        out = RowImages((patches, tuple(grid)) for patches, grid in
                        zip(pixels.split(grids.prod(-1).tolist()), grids.tolist())) if images else RowImages()
        out.urls = tuple(png_url(image) for image in images)
        return ids, out
