"""A LoRA policy's vLLM engine: the base loaded once, each sync sends the adapter only, in memory.

One engine start (one process, fp32, ``model.lora.rank=8``, ``alpha=16``: vLLM scales ``lora_B`` by 2), an
*attached* server (``rollout.engine_urls``, started here as docs/INFERENCE.md says: ``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), so the job registers the adapter by path (``/v1/load_lora_adapter``) before
the in-memory syncs; the job's own engines load it with ``--lora-modules`` (tests/job/test_lora_job.py). RL steps of
generate -> train_step -> update_weights, checked every step:
- agreement: ``rollout/logprob_abs_diff_max`` (the engine's log-probs of its samples vs the trainer's) <= 1e-4;
- what was sent: ``rollout/weight_sync_bytes`` is the adapter's bytes exactly (A and B of 7 modules x 2 layers),
  and the engine holds bitwise the trainer's adapter tensors after the install (sha256 per peft name).
The two traps (docs/LORA.md section 5), each planted in one sync after the clean steps:
- no clone: vLLM scales the received ``lora_B`` in place, so the engine's copy of what it received no longer
  equals the trainer's tensors (our buffers are fresh per sync, so agreement itself survives: asserted too);
- no prefix-cache reset: the next rollouts reuse KV blocks of the long prompts computed with the old adapter
  (vLLM keys them by the adapter's name and path): agreement fails (> 10x the tolerance).
"""

from __future__ import annotations

import pytest
from tests.support.grpo_batch import even_token_rollouts
from tests.support.multirank import run_ranks

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOLERANCE = 1e-4
RANK, ALPHA = 8, 16
CLEAN_STEPS = 3


def rl_loop(rank: int, world_size: int, hf_dir: str, engine_py: str, work_dir: str) -> dict:
    """Clean steps, then the no-clone sync, then the no-reset sync; rank 0 returns what the test asserts."""
    import os

    os.environ["MEGATRON_RL_ENGINE_PYTHON"] = engine_py
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf import policy_from_hf
    from megatron_rl.hf.lora import peft_adapter_tensors
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.engine import VLLMEngine
    from megatron_rl.inference.engine_process.vllm_worker import tensor_digest
    from megatron_rl.trainer import Trainer

    import subprocess

    from megatron_rl.inference.vllm.server import REPO_ROOT, EngineServer, free_port

    token = "lora-test-token"
    os.environ["MEGATRON_RL_ENGINE_TOKEN"] = token  # the job reads it for attached servers
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=str(REPO_ROOT), VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    with open(f"{work_dir}.attached.log", "wb") as log:
        server = subprocess.Popen(
            [engine_py, "-m", "megatron_rl.inference.engine_process.vllm_serve", "--parent-pid", str(os.getpid()), hf_dir,
             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "megatron_rl", "--dtype", "float32",
             "--max-model-len", "256", "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
             "--no-enable-chunked-prefill", "--enforce-eager", "--enable-prefix-caching", "--enable-lora",
             "--max-lora-rank", str(RANK), "--max-loras", "1", "--max-cpu-loras", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO_ROOT))
    attached = EngineServer(f"http://127.0.0.1:{port}", token, proc=server)  # (owned here, only to be killed)
    cfg = load_config(None, [
        "parallel.device=cpu", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "optimizer.lr=2e-2",
        "optimizer.lr_warmup_steps=0", "batch.train_batch_size=4", "batch.policy_mini_batch_size=4",
        "algorithm.advantage_estimator=grpo", "algorithm.policy_loss_type=regular",
    ], world_size=world_size)  # fmt: skip
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir)
    trainer = Trainer(policy.config, policy)
    rollout = RolloutConfig(engine="vllm", num_engines=0, engine_urls=[attached.url], bucket_mb=0.05)
    try:
        engine = VLLMEngine.start(policy, rollout, hf_dir=hf_dir, work_dir=work_dir)
    except BaseException:
        attached.kill()
        raise
    engine.record_digests = True
    spec = SamplingSpec(max_tokens=6, temperature=1.0, stop_token_ids=(2,))
    long = [[(7 * i + k) % 200 + 3 for i in range(150)] for k in range(2)]  # > one 128-token CPU KV block
    prompts = long + [[5, 6, 7], [8, 9]]

    def trainer_digests() -> dict:
        return {name: tensor_digest(t) for name, t in peft_adapter_tensors(policy.module, groups).items()}

    out: dict = {"diffs": [], "bytes": [], "digests_equal": [], "b_scaled": []}
    try:
        for step in range(CLEAN_STEPS + 3):
            if step == CLEAN_STEPS:
                engine.lora_clone = False  # planted in the sync after this step
            if step == CLEAN_STEPS + 1:
                engine.lora_clone, engine.reset_prefix_cache = True, False
            group_prompts = [p for p in prompts for _ in range(4)]
            completions = engine.generate(group_prompts, spec, seed=step)
            metrics = trainer.train_step(even_token_rollouts(group_prompts, completions))
            out["diffs"].append(metrics["rollout/logprob_abs_diff_max"])
            engine.update_weights(policy)
            out["bytes"].append(engine.last_sync_bytes)
            mine, theirs = trainer_digests(), engine.digests()
            out["digests_equal"].append(mine == theirs)
            out["b_scaled"].append(sorted(n for n in mine if mine[n] != theirs.get(n)))
        tensors = peft_adapter_tensors(policy.module, groups)
        out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        out["adapter_names"] = sorted(tensors)
        out["full_bytes"] = sum(p.numel() * p.element_size() for n, p in policy.module.named_parameters()
                                if "lora" not in n)
    finally:
        engine.close()
        attached.kill()
    return out


def test_lora_sync_sends_the_adapter_only_and_both_traps_are_caught(engine_hf_model, engine_py, tmp_path):
    result = run_ranks(1, rl_loop, str(engine_hf_model), engine_py, str(tmp_path / "engine"), timeout=600)[0]
    diffs, clean = result["diffs"], CLEAN_STEPS
    # diffs[0]: the exported base + zero-B adapter; diffs[1..clean]: after clean adapter syncs
    assert max(diffs[:clean + 1]) <= TOLERANCE, diffs
    assert diffs[clean + 1] <= TOLERANCE, diffs  # after the uncloned install: our fresh buffers keep it right
    assert diffs[clean + 2] > 10 * TOLERANCE, diffs  # after the sync without a prefix-cache reset: stale KV
    assert len(result["adapter_names"]) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    assert result["bytes"][:clean] == [result["adapter_bytes"]] * clean
    assert result["full_bytes"] > 2 * result["adapter_bytes"]
    assert result["digests_equal"][:clean] == [True] * clean
    # the uncloned install: vLLM scaled every received lora_B (alpha / r = 2), and nothing else
    scaled = result["b_scaled"][clean]
    assert scaled and all(".lora_B." in name for name in scaled), scaled
    assert result["digests_equal"][clean + 1], "the clone is back: the engine's tensors are the trainer's again"
