"""Which tests the oldest end of the supported megatron-core range runs: ``CORE`` (marker ``core``, set by
tests/conftest.py; docs/TESTING.md section 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

# What can break with another megatron-core version: everything that builds a megatron-core model or runs its
# schedule, DDP, optimizer, checkpointing, MoE or CP code, or depends on a version-specific patch or warning
# (patches/, docs/MEGATRON_CORE.md), and the main job once per engine kind. A path (from the repository root)
# names a file or a folder (every test in it), or ``file::test`` (one test, parameters included). The rest
# (algorithms and data in plain torch, environments, config, the fleet's serving, the job's bookkeeping,
# benchmarks' helpers) runs on the newest end only: its code does not touch megatron-core, so the other end
# cannot break it. ``pytest.mark.core`` on a test adds it too.
CORE = (
    "tests/model/", "tests/checkpoint/", "tests/moe/", "tests/cp/",
    "tests/distributed/test_bootstrap.py", "tests/critic/test_critic_multirank.py",
    "tests/hf/test_hf_multirank.py", "tests/hf/test_hf_moe.py", "tests/hf/test_stage_weights.py",
    "tests/hf/test_hf_moe_engine.py", "tests/hf/test_hf_lora.py", "tests/data/test_packing.py",
    "tests/inference/test_kv_cache.py",  # the built-in engine's incremental decoding through the Megatron model
    "tests/test_patches.py", "tests/test_warnings_filter.py", "tests/test_failures.py", "tests/test_lazy_compile.py",
    # the main job once per engine kind: on the built-in engine DP2 + resume (+ its GPU form); the other layouts,
    # MoE and CP of a job are the megatron-core code the tests above run (tests/model, tests/moe, tests/checkpoint)
    "tests/inference/test_builtin_multirank.py", "tests/job/test_main_job.py::test_run_megatron_dp2_then_resume",
    "tests/job/test_main_job.py::test_main_job_on_one_gpu_then_resume",
    "tests/job/test_cp_main_job.py",  # the CP job (CP's megatron-core code: tests/cp/)
    # the trainer's weights into the vLLM engine: the layout that streams TP-gathered weights from two pipeline
    # stages, and tied embeddings (the per-layout export itself: tests/hf/test_stage_weights.py; the other layouts
    # and the planted bugs test megatron_rl's own sync code, which runs the same on both ends)
    "tests/inference/test_vllm_sync.py::test_engine_matches_trainer_every_step_and_a_planted_sync_bug_is_caught"
    "[TP2xPP2-None]",
    "tests/inference/test_vllm_sync.py::test_tied_embeddings_follow_every_sync",
    "tests/examples/test_examples.py::test_grpo_step_tp2_equals_one_process",
)


def is_core(item: pytest.Item) -> bool:
    path = Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
    name = f"{path}::{item.originalname}" if hasattr(item, "originalname") else path
    full = f"{path}::{item.name}"  # with its parameters
    return any(path.startswith(p) if p.endswith("/") else p in (path, name, full) for p in CORE)
