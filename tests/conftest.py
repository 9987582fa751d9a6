"""Shared test set-up: GPU tests skip cleanly without CUDA; collection never needs CUDA; every ``multirank`` test
is also ``slow`` (``pytest -m "not slow"``: the edit-test subset, README)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multirank" in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
