"""Shared test set-up: GPU tests skip cleanly without CUDA; collection never needs CUDA; every ``multirank`` and
``engine`` test is also ``slow`` (``pytest -m "not slow"``: the edit-test subset, README); ``core`` marks the tests
that the oldest end of the megatron-core range runs (``ends.py``, docs/TESTING.md section 2).
"""

from __future__ import annotations

import engine_zygote
import pytest
import torch
from ends import is_core


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multirank" in item.keywords or "engine" in item.keywords:
            item.add_marker(pytest.mark.slow)
        if is_core(item):
            item.add_marker(pytest.mark.core)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    engine_zygote.start(session.items)  # tests/engine_zygote.py


def pytest_unconfigure(config):
    engine_zygote.stop()
