"""The real vLLM engine fed in place: after every sync it samples from exactly the trainer's weights.

Proof per layout (DP2, TP2, PP2, TP2xPP2): 8 consecutive RL steps of generate (engine) -> train_step ->
update_weights; each step's ``rollout/logprob_abs_diff_max`` (the engine's log-probs of its own samples vs the
trainer's recomputation with the same weights) stays <= 1e-4. Tolerance: both sides are fp32; the engine
computes with other kernels (oneDNN GEMMs, its own attention), measured ~4e-6 on this model, so 1e-4 is 25x
the noise while a stale tensor moves log-probs by >= 1e-3 after one step at lr 1e-3 (the planted bugs below).
Planted bugs, in the same runs after the 8 clean steps (one engine start per layout): one bucket's tensors not
loaded (DP2), one pipeline stage not sent (PP2): the steps after the planted sync must exceed the tolerance.
"""

from __future__ import annotations

import pytest
from tests.support.grpo_batch import even_token_rollouts
from tests.support.multirank import run_ranks

pytestmark = [pytest.mark.engine, pytest.mark.multirank]

TOLERANCE = 1e-4
LAYOUTS = {"DP1": (1, 1, 1), "DP2": (1, 1, 2), "TP2": (2, 1, 2), "PP2": (1, 2, 2), "TP2xPP2": (2, 2, 4)}


def rl_loop(rank: int, world_size: int, hf_dir: str, engine_py: str, work_dir: str, tp: int, pp: int,
            steps: int, planted: str | None, bucket_mb: float, transport: str = "auto") -> dict:
    """``steps`` clean RL steps with vLLM rollouts (then, with ``planted``, the bug planted in the last sync and
    two more steps); rank 0 returns the per-step mismatch and the sync stats of the last clean sync."""
    import os

    os.environ["MEGATRON_RL_ENGINE_PYTHON"] = engine_py
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf import policy_from_hf
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.engine import VLLMEngine
    from megatron_rl.trainer import Trainer

    cfg = load_config(None, [
        "parallel.device=cpu", f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        "optimizer.lr=1e-3", "optimizer.lr_warmup_steps=0", "batch.train_batch_size=4", "batch.policy_mini_batch_size=2",
        "algorithm.advantage_estimator=grpo", "algorithm.policy_loss_type=regular",
    ], world_size=world_size)  # fmt: skip
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir)
    trainer = Trainer(policy.config, policy)
    rollout = RolloutConfig(engine="vllm", bucket_mb=bucket_mb, weight_transport=transport)
    engine = VLLMEngine.start(policy, rollout, hf_dir=hf_dir, work_dir=work_dir)

    def plant() -> None:
        if planted == "skip_bucket" and engine.sender is not None and engine.sender.sender:
            engine.sender.skip_bucket = 1
        if (planted == "skip_stage" and engine.sender is not None and engine.sender.sender
                and groups.pp_rank == groups.pp_size - 1):
            engine.sender.skip_bucket = 0

    spec = SamplingSpec(max_tokens=6, temperature=1.0, stop_token_ids=(2,))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    diffs, sync_s, stats = [], [], {}
    try:
        for step in range(steps + (2 if planted else 0)):
            if step == steps - 1 and planted:
                stats = _stats(engine, groups)
                plant()  # in the sync after this step
            group_prompts = [p for p in prompts for _ in range(4)]
            completions = engine.generate(group_prompts, spec, seed=step)
            rollouts = even_token_rollouts(group_prompts, completions)
            metrics = trainer.train_step(rollouts)
            diffs.append(metrics["rollout/logprob_abs_diff_max"])
            sync_s.append(engine.update_weights(policy))
        stats = stats or _stats(engine, groups)
    finally:
        engine.close()
    return {"diffs": diffs, "sync_s": sync_s, "stats": stats}


def _stats(engine, groups) -> dict:
    """The last sync's stats, with the number of tensors every rank sent."""
    stats = dict(engine.last_stats)
    stats["sender_total"] = _sum_over_ranks(engine.last_sender_tensors, groups)
    return stats


def _sum_over_ranks(value: int, groups) -> int:
    import torch
    import torch.distributed as dist

    total = torch.tensor([value])
    dist.all_reduce(total)
    return int(total)


def _run(layout: str, hf_dir, engine_py, tmp_path, *, steps: int, planted: str | None = None,
         bucket_mb: float = 0.05, transport: str = "auto") -> dict:
    tp, pp, world = LAYOUTS[layout]
    results = run_ranks(world, rl_loop, str(hf_dir), engine_py, str(tmp_path / "engine"), tp, pp, steps, planted,
                        bucket_mb, transport, timeout=600)
    return results[0]


@pytest.mark.parametrize(("layout", "planted"), [("DP2", "skip_bucket"), ("TP2", None), ("PP2", "skip_stage"),
                                               ("TP2xPP2", None)])
def test_engine_matches_trainer_every_step_and_a_planted_sync_bug_is_caught(layout, planted, engine_hf_model,
                                                                            engine_py, tmp_path):
    # bucket 0.05 MiB: the tiny model's 0.6 MiB goes in many buckets, and its embedding (64 KiB) alone
    result = _run(layout, engine_hf_model, engine_py, tmp_path, steps=8, planted=planted)
    diffs = result["diffs"]
    assert len(diffs) == (10 if planted else 8)
    assert max(diffs[:8]) <= TOLERANCE, diffs  # diffs[0]: before the first sync, the exported initial weights
    if planted:  # the sync after step 8 left a bucket (DP2) or the last stage (PP2) out: caught at once
        assert max(diffs[8:]) > 10 * TOLERANCE, diffs
    stats = result["stats"]
    # every HF tensor once: 11 per layer (q/k/v/o, q/k norms, gate/up/down, 2 norms) + embedding, norm, lm_head
    assert stats["engine"]["tensors"] == stats["sender_total"] == 2 * 11 + 3
    assert stats["engine"]["buckets"] > 3


def test_tied_embeddings_follow_every_sync(engine_tied_model, engine_py, tmp_path):
    # tied + PP2: the first stage sends the embedding, the last stage's output-layer copy is not sent, and the
    # engine must refresh its output layer after every reload (W19 in docs/MEGATRON_CORE.md)
    diffs = _run("PP2", engine_tied_model, engine_py, tmp_path, steps=8)["diffs"]
    assert max(diffs) <= TOLERANCE, diffs


def test_disk_transport(engine_tied_model, engine_py, tmp_path):
    # the fallback for an engine started elsewhere: HF safetensors written, then reloaded by the engine
    result = _run("DP1", engine_tied_model, engine_py, tmp_path, steps=5, transport="disk")
    assert max(result["diffs"]) <= TOLERANCE, result["diffs"]
