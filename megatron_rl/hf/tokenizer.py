"""Tokenizer of a local Hugging Face checkpoint directory, and its pad token id.

Place in the data flow: set-up; the pad token id feeds ``data.batch.convert_prompts_responses_to_batch_tensors``
(left padding) and the DP padding rows. Only local directories are read (no downloads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(hf_dir: str | os.PathLike) -> Any:
    """``AutoTokenizer`` of ``hf_dir``; ValueError if there is none or it has no pad token."""
    from transformers import AutoTokenizer

    if not Path(hf_dir).is_dir():
        raise ValueError(f"model.hf_path={str(hf_dir)!r} is not a directory; point it at a local HF checkpoint")
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model.hf_path={str(hf_dir)!r}: no loadable tokenizer ({err}); save one there with "
            "tokenizer.save_pretrained(hf_path)"
        ) from err
    pad_token_id(tokenizer, hf_dir)
    return tokenizer


def pad_token_id(tokenizer: Any, where: str | os.PathLike = "tokenizer") -> int:
    """The tokenizer's pad token id; ValueError naming the fix if it has none."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"{where}: the tokenizer has no pad token (pad_token_id is None); set one in its "
            "tokenizer_config.json (e.g. \"pad_token\": \"<|endoftext|>\") or tokenizer.pad_token = ... before "
            "save_pretrained"
        )
    return int(tokenizer.pad_token_id)
