"""Fixtures of the environment tests: the arithmetic example's word-level tokenizer (no model, no downloads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"arithmetic_{name}", ROOT / "examples" / "arithmetic" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_example("make_model").save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
