"""A token prompt's images as a vLLM engine takes them (``server.py: EngineServer.sample(images=...)``).

The trainer owns tokenization: its prompt holds each image's placeholder run already expanded
(``data/images.py``: ``<|vision_start|>``, ``t*h*w/4`` image tokens, ``<|vision_end|>``). vLLM (0.32,
``/inference/v1/generate`` with ``content_parts``) takes a token prompt with one image token per image and expands
it itself, after running the checkpoint's image processor on the image: a prompt sent expanded would be expanded
again. So each run of image tokens goes as one token, the images as URLs (``data:`` URLs: no file crosses hosts),
and the engine's expanded prompt (returned with ``return_token_ids``) must equal the trainer's token for token:
else the two image processors disagree on an image's size, and the request is refused (``EngineError``), never
sampled from a prompt the trainer would not score.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.inference.engine import EngineError


@dataclass(frozen=True)
class EngineImages:
    """One prompt's images, in order: ``urls`` (``data:image/png;base64,...`` or any URL the engine can read) and
    the checkpoint's image token id (Qwen2.5-VL: ``config.image_token_id``)."""

    urls: tuple[str, ...]
    image_token: int

    def request(self, prompt: list[int]) -> dict:
        """The request fields: the prompt with each image-token run as one token, and the images."""
        collapsed = [t for i, t in enumerate(prompt) if t != self.image_token or i == 0 or prompt[i - 1] != t]
        runs = collapsed.count(self.image_token)
        if runs != len(self.urls):
            raise ValueError(f"the prompt has {runs} image-token runs (token {self.image_token}) for "
                             f"{len(self.urls)} images")
        return {"token_ids": collapsed, "return_token_ids": True,
                "content_parts": [{"type": "image_url", "url": url} for url in self.urls]}

    def check(self, prompt: list[int], expanded: list[int] | None, url: str) -> None:
        """EngineError unless the engine expanded the images to the trainer's prompt."""
        if expanded is not None and [int(t) for t in expanded] == prompt:
            return
        ours, theirs = prompt.count(self.image_token), (expanded or []).count(self.image_token)
        raise EngineError(f"{url} expanded the prompt's {len(self.urls)} image(s) to {theirs} image tokens, the "
                          f"trainer's image processor to {ours}: the engine's and the trainer's image processors "
                          "disagree (same checkpoint folder and processor settings on both sides?)")
