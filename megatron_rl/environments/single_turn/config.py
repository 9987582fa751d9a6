"""The ``data`` and ``reward`` config sections of the ``single_turn`` environment (prompt file + reward function)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_rl.config import AT_LEAST_1, ConfigError, ConfigSection


@dataclass(kw_only=True)
class DataConfig(ConfigSection):
    """Prompt files (``job.environment: single_turn``). Each row is one prompt; its other columns go to the
    reward function as keyword arguments."""

    SECTION: ClassVar[str] = "data"

    train_files: list[str] | str | None = None
    """JSONL (``.jsonl``/``.json``, one object per line) or Parquet (``.parquet``) file(s) of training prompts:
    one path or a list; rows of several files are concatenated in the order given."""
    val_files: list[str] | str | None = None
    """Held-out prompt file(s) for ``eval.interval`` (same formats); None = no evaluation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string (tokenized as is), or a list of chat messages
    (``[{"role": ..., "content": ...}]``) rendered with the tokenizer's chat template (generation prompt added);
    a message list with a tokenizer that has no chat template is an error."""
    max_prompt_tokens: int | None = field(default=None, metadata=AT_LEAST_1)
    """Longest prompt (tokens) kept; longer ones are counted, reported and skipped (never truncated). None =
    ``model.max_position_embeddings - job.max_new_tokens``."""
    image_key: str | None = None
    """Column holding each row's images (docs/VISION.md): one or a list of paths (relative to the directory you
    run the command from, else to the prompt file's), ``data:`` URLs or base64 text, one per image placeholder of
    the prompt (Qwen2.5-VL: its image pad token between vision start and end, as its chat template writes),
    encoded by the image processor of ``model.hf_path`` (a vision-language checkpoint). A row whose image is missing or unreadable (or whose
    placeholders do not match its images) is a failed row: counted, named in the log, left out, never a crash.
    ``rollout.engine``: builtin or vllm (docs/VISION.md section 9). With a step-API class: the first prompt's images
    (an unreadable one fails that episode; docs/VISION.md section 14); refused with ``job.agent``. None = text
    prompts."""
    shuffle: bool = True
    """Visit the training rows in a new order every epoch, drawn from the run's seed (False: file order)."""

    def paths(self, which: str) -> list[str]:
        """``train_files`` or ``val_files`` as a list (empty when unset)."""
        value = getattr(self, which)
        return [] if value is None else [value] if isinstance(value, str) else list(value)

    def _check_rules(self) -> None:
        for which in ("train_files", "val_files"):
            value = getattr(self, which)
            if not (value is None or isinstance(value, str)
                    or (isinstance(value, list) and all(isinstance(p, str) for p in value))):
                raise ConfigError(f"data.{which}={value!r} must be a path or a list of paths")


@dataclass(kw_only=True)
class RewardConfig(ConfigSection):
    """The reward of the ``single_turn`` environment."""

    SECTION: ClassVar[str] = "reward"

    function: str | None = None
    """``path/to/file.py:name`` or ``package.module:name``: called as ``name(prompt=<text>, response=<text>,
    **other_columns)`` and returning a float, or a dict with ``reward`` (a float) and other numbers, logged as
    ``reward_fn/<key>`` (means over the step's responses). Checked once at start-up on the first training row.
    None (unset) only under ``distillation.teachers`` with ``distillation.coef > 0``: every reward is 0, pure
    distillation (docs/DISTILLATION.md; an evaluation then reports 0 too)."""
