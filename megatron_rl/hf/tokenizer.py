"""Tokenizer of a local Hugging Face checkpoint directory, and its pad token id.

Place in the data flow: set-up; the pad token id feeds ``data.batch.convert_prompts_responses_to_batch_tensors``
(left padding) and the DP padding rows. Only local directories are read (no downloads).

No silent stand-ins: for a directory without tokenizer files, transformers 5.x builds a made-up tokenizer from
``config.json`` alone (one token, pad id 0). ``load_tokenizer`` refuses that with a ValueError; a caller who
knows the pad id passes it explicitly instead (``policy_from_hf(..., pad_token_id=...)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_rl.hf.config import HF_DIR_KEY

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files that hold a tokenizer's vocabulary (one of them must exist; ``tokenizer_config.json`` alone does not)."""


def _no_tokenizer(hf_dir: str | os.PathLike, why: str, key: str) -> ValueError:
    return ValueError(
        f"{key}={str(hf_dir)!r}: {why}; add the tokenizer files there (tokenizer.save_pretrained({key})) "
        "or pass the pad id explicitly: policy_from_hf(..., pad_token_id=<your pad id>)"
    )


def load_tokenizer(hf_dir: str | os.PathLike, *, key: str = HF_DIR_KEY) -> Any:
    """``AutoTokenizer`` of ``hf_dir``; ValueError (naming ``key``, ``hf/config.py: HF_DIR_KEY``) if there is
    none, a made-up one, or one without a pad token."""
    from transformers import AutoTokenizer

    path = Path(hf_dir)
    if not path.is_dir():
        raise ValueError(f"{key}={str(hf_dir)!r} is not a directory; point it at a local HF checkpoint")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise _no_tokenizer(hf_dir, f"no loadable tokenizer: no tokenizer files (none of {', '.join(TOKENIZER_FILES)})",
                            key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _no_tokenizer(hf_dir, f"no loadable tokenizer ({err})", key) from err
    if len(tokenizer) <= 1:
        raise _no_tokenizer(hf_dir, f"the tokenizer has {len(tokenizer)} token(s), not a real vocabulary", key)
    pad_token_id(tokenizer, f"{key}={str(hf_dir)!r}")
    return tokenizer


def pad_token_id(tokenizer: Any, where: str | os.PathLike = "tokenizer") -> int:
    """The tokenizer's pad token id; ValueError naming the fix if it has none."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"{where}: the tokenizer has no pad token (pad_token_id is None); set one in its "
            "tokenizer_config.json (e.g. \"pad_token\": \"<|endoftext|>\") or tokenizer.pad_token = ... before "
            "save_pretrained, or pass the pad id explicitly: policy_from_hf(..., pad_token_id=<your pad id>)"
        )
    return int(tokenizer.pad_token_id)


def resolve_pad_token_id(hf_dir: str | os.PathLike, explicit: int | None = None, *,
                         key: str = HF_DIR_KEY) -> tuple[int, str]:
    """``(pad id, where it came from)``: ``explicit`` when given, else the tokenizer's (``load_tokenizer``)."""
    if explicit is not None:
        return int(explicit), "pad_token_id argument"
    tokenizer = load_tokenizer(hf_dir, key=key)
    return pad_token_id(tokenizer, f"{key}={str(hf_dir)!r}"), f"tokenizer {tokenizer.pad_token!r}"


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The eos id(s) that end a response; ValueError naming the fix if the tokenizer has none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("model.hf_path: the tokenizer has no eos token, so responses could not stop; set "
                         "eos_token in its tokenizer_config.json")
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
