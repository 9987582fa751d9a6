"""Shared test set-up: GPU tests skip cleanly without CUDA; collection never needs CUDA; every ``multirank`` and
``engine`` test is also ``slow`` (``pytest -m "not slow"``: the edit-test subset, README); ``core`` marks the tests
that the oldest end of the megatron-core range runs (``support/ends.py``, docs/TESTING.md section 2); ``groups``: the
one fixture of the tests that build a model in their own process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support import engine_zygote
from tests.support.engine_env import engine_python
from tests.support.ends import is_core

# run_megatron.sh derives threads per rank from the free cores (megatron_rl/job/threads.py); the jobs tests launch
# share the cores with the other xdist worker, so they keep one thread each (as before issue 53). Set after torch's
# import: this process's own threads are unchanged.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def groups(request):
    """One process's megatron groups (world size 1) for a module's tests, destroyed after them: seed
    ``GROUPS_SEED`` (default 3) and layout ``GROUPS_PARALLEL`` (default ``ParallelConfig()``) of the test module."""
    from megatron_rl.config import ParallelConfig
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    parallel = getattr(request.module, "GROUPS_PARALLEL", None) or ParallelConfig()
    yield initialize_distributed(parallel, seed=getattr(request.module, "GROUPS_SEED", 3))
    destroy_distributed()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multirank" in item.keywords or "engine" in item.keywords:
            item.add_marker(pytest.mark.slow)
        if is_core(item):
            item.add_marker(pytest.mark.core)
    if hasattr(config, "workerinput"):  # a worker of `pytest -n N` (scripts/test.sh): the heaviest files first
        _heaviest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _heaviest_files_first(items) -> None:
    """Order the files by a rough cost (an engine test ~60 s, another slow test ~20 s, the rest ~0.1 s on the 2-core
    machine; docs/TESTING.md section 1), keeping each file's own order: the workers take files in this order
    (``--dist loadfile --no-loadscope-reorder``), so the long ones start first and short ones fill the end instead of
    one long file running alone at the end (xdist's own order, by test count, put the engine files last)."""
    cost: dict = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + (
            60.0 if "engine" in item.keywords else 20.0 if "slow" in item.keywords else 0.1)
    items.sort(key=lambda item: -cost[item.path])


def pytest_collection_finish(session):
    engine_zygote.start(session.items)  # tests/support/engine_zygote.py


def pytest_unconfigure(config):
    engine_zygote.stop()


# The real vLLM engine (tests/inference/conftest.py says how it is required in CI)
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
