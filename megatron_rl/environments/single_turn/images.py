"""Prompt rows with images (``data.image_key``) for the ``single_turn`` environment: the checkpoint's image encoder
(``data/images.py``), the rows' token ids with their image tokens, and each step's images.

Place in the data flow: set-up (``PromptImages.tokenize``: every row read and encoded once, to check its images
and count its tokens; the patches are not kept) and every RL step (``PromptImages.images``: the step's prompts
encoded again, ``[(pixel_values [n, F], (t, h, w)), ...]`` per prompt, for the engine and for
``GeneratorOutput['images']``). Holding only the step's patches keeps a large image data set off the host memory;
the cost is the image processor run once more per prompt and step.

A row whose image is missing or unreadable, or whose placeholders do not match its images, is a failed row: left
out, counted (``Prompts.failed``), the first one named in the environment's log line; a file where every row
failed is a ``ConfigError``. Errors name ``data.image_key`` and ``model.hf_path``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.images import ImageEncoder, ImageError, image_refs, read_image
from megatron_rl.environments.single_turn.data import Prompt, Prompts, render_prompt

Images = list[tuple[torch.Tensor, tuple[int, int, int]]]
"""One prompt's images: each one's patches ``[n, F]`` and patch grid ``(t, h, w)`` (``data/mrope.py: batch_images``)."""


class RowImages(list):
    """``Images`` that also carry the images themselves as PNG ``data:`` URLs (``urls``, in order), which the vLLM
    engine takes (it runs the image processor itself: ``inference/vllm/images.py``)."""

    urls: tuple[str, ...] = ()


def png_url(image: Any) -> str:
    """A PIL image as a PNG ``data:`` URL (lossless: the engine reads back the pixels the trainer encoded)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def is_vision_checkpoint(hf_path: str | None) -> bool:
    """``model.hf_path`` is a vision-language checkpoint: its config.json has a vision tower and an image token (read
    as JSON: a model type transformers does not know is no vision-language checkpoint here)."""
    import json

    path = Path(hf_path) / "config.json" if hf_path is not None else None
    if path is None or not path.is_file():
        return False
    config = json.loads(path.read_text())
    return config.get("vision_config") is not None and config.get("image_token_id") is not None


def check_vision_checkpoint(hf_path: str | None, image_key: str) -> None:
    """ConfigError unless ``model.hf_path`` is a vision-language checkpoint (its config has a vision tower and an
    image token)."""
    from transformers import AutoConfig

    if hf_path is None:
        raise ConfigError(f"data.image_key={image_key!r} needs model.hf_path: a vision-language checkpoint "
                          "(Qwen2.5-VL) whose image processor encodes the images")
    config = AutoConfig.from_pretrained(hf_path, local_files_only=True)
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        raise ConfigError(f"data.image_key={image_key!r} needs a vision-language checkpoint, but model.hf_path="
                          f"{str(hf_path)!r} is a {getattr(config, 'model_type', '?')!r} model without a vision "
                          "tower; use a Qwen2.5-VL checkpoint, or unset data.image_key")


class PromptImages:
    """The images of ``data.image_key`` through the checkpoint's own image processor and tokenizer."""

    def __init__(self, image_key: str, hf_path: str | Path | None, base_dirs: Sequence[str | Path] = (".",)) -> None:
        """``base_dirs``: where a relative image path is looked for, in order (the first that has the file)."""
        check_vision_checkpoint(None if hf_path is None else str(hf_path), image_key)
        self.image_key, self.base_dirs = image_key, [Path(d) for d in base_dirs]
        self.encoder = ImageEncoder.from_checkpoint(hf_path)

    def tokenize(self, rows: list[dict[str, Any]], tokenizer: Any, *, prompt_key: str, max_prompt_tokens: int,
                 files_key: str) -> Prompts:
        """``tokenize_rows`` for rows with images: each image placeholder expanded to its image tokens; rows
        whose images cannot be read are ``failed``, rows longer than ``max_prompt_tokens`` ``skipped``."""
        kept, skipped, failed = [], 0, []
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise ConfigError(f"data.prompt_key={prompt_key!r}: row {i} of {files_key} has no such column (its "
                                  f"columns: {sorted(row)}); set data.prompt_key to the prompt's column")
            text = render_prompt(row[prompt_key], tokenizer, f"{files_key} row {i}, column {prompt_key!r}")
            try:
                ids, _, _ = self.encoder.encode(text, self._read(row))
            except ImageError as err:
                failed.append((i, f"{files_key} row {i}, column {self.image_key!r}: {err}"))
                continue
            if len(ids) > max_prompt_tokens:
                skipped += 1
                continue
            kept.append(Prompt(text, ids, {k: v for k, v in row.items() if k != prompt_key}, row=i))
        if not kept:
            first = f"; first failed row: {failed[0][1]}" if failed else ""
            raise ConfigError(f"no prompt of {files_key} is usable: {len(failed)} rows with images that cannot be "
                              f"read (data.image_key={self.image_key!r}), {skipped} longer than {max_prompt_tokens} "
                              f"tokens (data.max_prompt_tokens){first}")
        return Prompts(kept, skipped, failed)

    def _read(self, row: dict[str, Any]) -> list[Any]:
        return [read_image(self._resolve(ref), self.base_dirs[0]) for ref in image_refs(row, self.image_key)]

    def _resolve(self, ref: Any) -> Any:
        """A relative path found under one of ``base_dirs`` as that file's path; anything else as is."""
        if isinstance(ref, str) and not ref.startswith("data:") and len(ref) < 4096:
            found = next((d / ref for d in self.base_dirs if (d / ref).is_file()), None)
            return str(found) if found is not None else ref
        return ref

    def images(self, prompt: Prompt) -> Images:
        """The prompt's images, encoded again (its row's images were read at set-up: a file removed since then
        raises ``ImageError``); a ``RowImages``, with the images as PNG data URLs for the vLLM engine."""
        images = self._read({self.image_key: prompt.extra.get(self.image_key)})
        if not images:
            return []
        ids, pixels, grids = self.encoder.encode(prompt.text, images)
        assert ids == prompt.token_ids, "the image encoder gave other tokens than at set-up"
        sizes = grids.prod(-1).tolist()
        out = RowImages((patches, tuple(grid)) for patches, grid in zip(pixels.split(sizes), grids.tolist()))
        out.urls = tuple(png_url(image) for image in images)
        return out
