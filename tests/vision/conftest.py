"""The vision tests' tiny model per family: ``family`` (a module-scoped parameter; Qwen3.5 skipped below the
megatron-core it needs) and ``tiny`` (its ``tests/support`` module)."""

from __future__ import annotations

import pytest

from megatron_rl.model import hybrid
from tests.support import qwen2_5_vl_tiny, qwen35_vl_tiny

FAMILIES = {"qwen2_5_vl": qwen2_5_vl_tiny, "qwen35_vl": qwen35_vl_tiny}
"""The family each tiny model's checkpoint resolves to."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    if request.param == "qwen35_vl" and not hybrid.mcore_supports_hybrid():
        pytest.skip(f"Qwen3.5 needs megatron-core>={hybrid.MIN_MCORE}")
    return request.param


@pytest.fixture(scope="module")
def tiny(family):
    return FAMILIES[family]
