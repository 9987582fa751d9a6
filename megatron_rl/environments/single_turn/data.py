"""Prompt files -> rows (pyarrow), prompts -> token ids, and the seeded order the job visits them in.

Place in the data flow: set-up (``read_rows``, ``tokenize_rows``) and the start of every RL step
(``PromptOrder.next``) of the ``single_turn`` environment.

Order: epoch ``e`` visits every kept row once, in ``random.Random(seed * 1_000_003 + e)``'s shuffle of the
indices (file order when ``data.shuffle`` is false); a step takes the next ``num_prompts`` positions, crossing
into the next epoch when it runs out. ``PromptOrder.consumed`` (positions taken so far) is the whole state: it
goes into every checkpoint, so a resumed run sees exactly the prompts the uninterrupted run would.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


def read_rows(paths: Sequence[str], key: str, *, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows (dicts) of JSONL or Parquet files, concatenated (only the first ``max_rows`` of each file when given:
    the pre-flight's quick look); ConfigError naming ``key`` for a missing file, an unknown format, or an
    unreadable one."""
    if not paths:
        raise ConfigError(f"{key} is not set; set it to a JSONL or Parquet prompt file (or a list of them)")
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ConfigError(f"{key}={str(path)!r} is not a file; give the path of a JSONL or Parquet file "
                              "(relative paths are taken from the directory you run the command from)")
        rows += _read_file(path, key, max_rows)
    if not rows:
        raise ConfigError(f"{key}={list(paths)!r} holds no rows")
    return rows


def _read_file(path: Path, key: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(f"{key}: reading prompt files needs pyarrow, which is not installed; run "
                          "'bash scripts/setup.sh' again (it installs the job's extra) or 'pip install pyarrow'") from None

    try:
        if path.suffix in PARQUET_SUFFIXES:
            import pyarrow.parquet as pq

            if max_rows is None:
                return pq.read_table(path).to_pylist()
            first = next(pq.ParquetFile(path).iter_batches(batch_size=max_rows), None)
            return [] if first is None else first.to_pylist()
        if path.suffix in JSONL_SUFFIXES:
            import pyarrow.json as pj

            if max_rows is None:
                return pj.read_json(path).to_pylist()
            with path.open("rb") as f:
                head = b"".join(line for _, line in zip(range(max_rows), f))
            return pj.read_json(io.BytesIO(head)).to_pylist()
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"{key}: cannot read {str(path)!r} ({err})") from None
    raise ConfigError(f"{key}: {str(path)!r} is neither JSONL ({', '.join(JSONL_SUFFIXES)}) nor Parquet "
                      f"({', '.join(PARQUET_SUFFIXES)}); convert it or rename it")


def render_prompt(value: Any, tokenizer: Any, key: str) -> str:
    """The prompt text of one cell: a string as is, a chat message list through the chat template."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{key} holds chat messages but the tokenizer of model.hf_path has no chat template; "
                              "write the prompts as strings, or use a checkpoint whose tokenizer has one")
        return tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
    raise ConfigError(f"{key}: a prompt must be a string or a list of {{'role', 'content'}} messages, got "
                      f"{type(value).__name__}: {str(value)[:80]!r}")


@dataclass
class Prompt:
    """One usable row: its rendered text, its token ids and the columns the reward function receives."""

    text: str
    token_ids: list[int]
    extra: dict[str, Any]
    row: int = 0
    """Its row in the file(s) (0-based, rows of several files counted in the order given)."""


@dataclass
class Prompts:
    kept: list[Prompt]
    skipped: int
    """Rows longer than the limit (skipped, never truncated)."""
    failed: list[tuple[int, str]] = field(default_factory=list)
    """``(row, reason)`` of each row whose images could not be read (``data.image_key``), left out."""


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, *, prompt_key: str, max_prompt_tokens: int,
                  files_key: str) -> Prompts:
    """Render and tokenize every row; rows longer than ``max_prompt_tokens`` are counted and dropped."""
    kept, skipped = [], 0
    for i, row in enumerate(rows):
        if prompt_key not in row:
            raise ConfigError(f"data.prompt_key={prompt_key!r}: row {i} of {files_key} has no such column (its "
                              f"columns: {sorted(row)}); set data.prompt_key to the prompt's column")
        text = render_prompt(row[prompt_key], tokenizer, f"{files_key} row {i}, column {prompt_key!r}")
        ids = tokenizer(text, add_special_tokens=not isinstance(row[prompt_key], list))["input_ids"]
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        kept.append(Prompt(text, ids, {k: v for k, v in row.items() if k != prompt_key}, row=i))
    if not kept:
        raise ConfigError(f"every prompt of {files_key} is longer than {max_prompt_tokens} tokens "
                          "(data.max_prompt_tokens); raise it (and model.max_position_embeddings) or shorten them")
    return Prompts(kept, skipped)


class PromptOrder:
    """Seeded epoch-wise order over ``size`` rows; ``consumed`` is the checkpointed position."""

    def __init__(self, size: int, *, seed: int, shuffle: bool) -> None:
        assert size > 0
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.consumed = 0
        self._epoch, self._order = -1, list(range(size))

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def next(self, count: int) -> list[int]:
        """The next ``count`` row indices (crossing epochs as needed); advances ``consumed``."""
        taken = []
        for position in range(self.consumed, self.consumed + count):
            taken.append(self.epoch_order(position // self.size)[position % self.size])
        self.consumed += count
        return taken

    @property
    def epoch(self) -> int:
        return self.consumed // self.size

    def state_dict(self) -> dict[str, int]:
        """The position a checkpoint saves (an environment's ``state_dict``)."""
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; ``{}`` (a checkpoint without it) leaves the start position."""
        self.consumed = int(state.get("consumed", 0))
