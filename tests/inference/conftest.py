"""Engine tests run the real vLLM engine (``.venv-engine``, made by ``bash scripts/setup_engine.sh``).

``scripts/test.sh`` makes the engine environment and sets ``MEGATRON_RL_REQUIRE_ENGINE=1``, so in CI (and with
the README's test command) a missing engine fails these tests instead of skipping them. A plain ``pytest``
without the engine skips them with the set-up command.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def engine_python() -> str:
    """The engine's interpreter, or skip (fail under ``MEGATRON_RL_REQUIRE_ENGINE=1``)."""
    path = os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(REPO / ".venv-engine" / "bin" / "python")
    if Path(path).is_file():
        return path
    message = f"no vLLM engine environment at {path}: run `bash scripts/setup_engine.sh`"
    if os.environ.get("MEGATRON_RL_REQUIRE_ENGINE") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def engine_py() -> str:
    return engine_python()


@pytest.fixture(scope="session")
def engine_hf_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (head_dim 32: vLLM's CPU attention supports 32 and up, not 16) with a tokenizer."""
    from hf.conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("engine_model") / "qwen3", "qwen3", seed=3)
