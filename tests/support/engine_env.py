"""Where the tests find the vLLM engine's environment (``.venv-engine``, made by ``bash scripts/setup_engine.sh``).

``scripts/test.sh`` makes it and sets ``MEGATRON_RL_REQUIRE_ENGINE=1``, so with the README's test command (and in
CI) a missing engine fails the engine tests; a plain ``pytest`` without it skips them, naming the set-up command.
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
