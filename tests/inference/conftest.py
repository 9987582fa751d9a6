"""Engine tests run the real vLLM engine (``.venv-engine``, made by ``bash scripts/setup_engine.sh``).

``scripts/test.sh`` makes the engine environment and sets ``MEGATRON_RL_REQUIRE_ENGINE=1``, so in CI (and with
the README's test command) a missing engine fails these tests instead of skipping them. A plain ``pytest``
without the engine skips them with the set-up command.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.engine_env import engine_python

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def engine_py() -> str:
    return engine_python()


@pytest.fixture(scope="session")
def engine_hf_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (head_dim 32: vLLM's CPU attention supports 32 and up, not 16) with a tokenizer."""
    from tests.hf.conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("engine_model") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="session")
def engine_tied_model(tmp_path_factory) -> Path:
    """The examples' tiny Qwen3 with tied embeddings and a padded vocabulary (37 -> 64 rows in vLLM), head size 32."""
    from tests.support.job_run import example_module

    return example_module("examples/common.py").tiny_qwen3(tmp_path_factory.mktemp("engine_tied") / "qwen3_tied", head_dim=32)
