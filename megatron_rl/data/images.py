"""Images of prompt rows -> token ids with image placeholders and pixel patches, through the checkpoint's own
image processor and tokenizer (docs/VISION.md section 7). No Megatron; PIL and transformers only.

Place in the data flow: where a prompt file's rows become prompts (the rollout side), before generation; what
it returns becomes the policy batch's ``pixel_values`` / ``image_grid_thw`` (``data/mrope.py: batch_images``).

    row {prompt_key: "... <image> ...", image_key: ["a.png", "data:image/png;base64,..."]}
      image refs        a path (relative to ``base_dir``), a ``data:`` URL, or raw base64 (one or a list)
      read_image        -> RGB PIL image; ImageError naming the row and the file when missing or unreadable
      ImageEncoder      the checkpoint's image processor (``AutoImageProcessor``: resizes, cuts patches) and
                        tokenizer; each image placeholder of the text becomes its t*h*w/merge**2 image tokens
      -> EncodedPrompt  input_ids [n], pixel_values [N, F], image_grid_thw [k, 3]

Why not ``AutoProcessor``: transformers 5's ``Qwen2_5_VLProcessor`` also builds a video processor, which needs
torchvision (not installed in the trainer's venv); its image processor falls back to PIL
(``Qwen2VLImageProcessorPil``), and the placeholder expansion is the processor's own rule, done here.

A row whose image cannot be read is a failed row (``encode_rows`` returns it with the reason), never a crash.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class ImageError(ValueError):
    """An image reference that cannot be read (the message names it)."""


@dataclass
class EncodedPrompt:
    row: int
    """The row's index in its file."""
    input_ids: list[int]
    """The prompt's tokens, each image placeholder expanded to its image tokens."""
    pixel_values: torch.Tensor
    """``[N, F]`` the images' patches (the processor's layout), ``[0, F]`` without images."""
    image_grid_thw: torch.Tensor
    """``[k, 3]`` int64 each image's (t, h, w) in patches."""


def read_image(ref: Any, base_dir: str | Path = ".") -> Any:
    """An RGB ``PIL.Image`` from a ``PIL.Image``, a path (relative to ``base_dir``), a ``data:`` URL or raw base64
    text/bytes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    try:
        if isinstance(ref, (bytes, bytearray)):
            data = bytes(ref)
        elif isinstance(ref, str) and ref.startswith("data:"):
            data = base64.b64decode(ref.split(",", 1)[1], validate=True)
        elif isinstance(ref, str) and (Path(base_dir) / ref).is_file():
            data = (Path(base_dir) / ref).read_bytes()
        elif isinstance(ref, str) and _looks_like_a_path(ref):
            raise ImageError(f"image {_describe(ref)}: no such file under {str(base_dir)!r}")
        elif isinstance(ref, str) and len(ref) > 64:  # too long for a file name we were given: base64
            data = base64.b64decode(ref, validate=True)
        else:
            raise ImageError(f"image {_describe(ref)} is no file under {str(base_dir)!r}, data: URL or base64")
        image = Image.open(io.BytesIO(data))
        image.load()
    except (binascii.Error, IndexError, UnidentifiedImageError, OSError) as err:
        raise ImageError(f"image {_describe(ref)} cannot be read ({type(err).__name__}: {err})") from None
    return image.convert("RGB")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


def _looks_like_a_path(ref: str) -> bool:
    """A file name we were given, not base64 (which may hold '/' too, and starts with '/9j/' for a JPEG)."""
    return ref.lower().endswith(IMAGE_SUFFIXES) or (ref.startswith(("/", "./", "../", "~")) and not ref.startswith("/9j/"))


def _describe(ref: Any) -> str:
    """The reference as a message names it: a long one cut in the middle (a path keeps its file name)."""
    text = ref if isinstance(ref, str) else f"<{len(ref)} bytes>" if isinstance(ref, (bytes, bytearray)) else repr(ref)
    return repr(text if len(text) <= 80 else text[:30] + "..." + text[-45:])


def image_refs(row: dict[str, Any], image_key: str) -> list[Any]:
    """The row's image references (none when the column is absent or empty)."""
    value = row.get(image_key)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class ImageEncoder:
    """What turns a prompt's text and images into model inputs."""

    image_processor: Any
    tokenizer: Any
    image_token: str
    """The placeholder the text holds once per image (Qwen2.5-VL: ``<|image_pad|>``), expanded to the image's
    tokens."""
    merge_size: int

    @classmethod
    def from_checkpoint(cls, hf_path: str | Path) -> ImageEncoder:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(hf_path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(hf_path, local_files_only=True)
        processor = AutoImageProcessor.from_pretrained(hf_path, local_files_only=True)
        return cls(processor, tokenizer, tokenizer.convert_ids_to_tokens(config.image_token_id),
                   config.vision_config.spatial_merge_size)

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``(input_ids, pixel_values [N, F], image_grid_thw [k, 3])`` of one prompt whose ``text`` holds one
        ``image_token`` per image, in order."""
        text, pixels, grids = self.expand(text, images)
        return self.tokenizer(text)["input_ids"], pixels, grids

    def expand(self, text: str, images: list[Any]) -> tuple[str, torch.Tensor, torch.Tensor]:
        """``(text with each image_token repeated t*h*w/merge**2 times, pixel_values [N, F], image_grid_thw
        [k, 3])``; ImageError when ``text`` does not hold one ``image_token`` per image."""
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise ImageError(f"the prompt has {len(parts) - 1} image placeholders ({self.image_token!r}) for "
                             f"{len(images)} images")
        if not images:
            return text, torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"].long()
        counts = (grids.prod(-1) // self.merge_size**2).tolist()
        text = parts[0] + "".join(self.image_token * n + part for n, part in zip(counts, parts[1:]))
        return text, out["pixel_values"].float(), grids


def encode_rows(rows: list[dict[str, Any]], encoder: ImageEncoder, *, prompt_key: str, image_key: str,
                base_dir: str | Path = ".") -> tuple[list[EncodedPrompt], list[tuple[int, str]]]:
    """Every row that can be encoded, and ``(row, reason)`` for each one that cannot (a missing or unreadable
    image, a placeholder count that does not match its images): counted, reported, never raised."""
    kept, failed = [], []
    for i, row in enumerate(rows):
        try:
            images = [read_image(ref, base_dir) for ref in image_refs(row, image_key)]
            ids, pixels, grids = encoder.encode(row[prompt_key], images)
        except ImageError as err:
            failed.append((i, f"row {i}, column {image_key!r}: {err}"))
            continue
        kept.append(EncodedPrompt(i, ids, pixels, grids))
    return kept, failed
