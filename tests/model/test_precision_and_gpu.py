"""Reduced precision (bf16, on CPU in CI) and the GPU paths (CUDA, NCCL, TransformerEngine; marked ``gpu``).

Each check runs a ``MegatronPolicy`` in a spawned rank and compares it with the same weights in fp32: the
fp32 run is the reference, so a wrong cast, a missing device move or a TE/THD mismatch shows as a large
difference while bf16 rounding stays inside the stated tolerance.

Tolerance for bf16 (8 significant bits, relative rounding 2**-9 = 2e-3 per operation): the tiny 2-layer
model's logits are O(1), a few roundings per layer give log-prob errors of a few 1e-3 (measured on CPU:
max 2.2e-3); 2e-2 leaves room for longer reductions on GPU kernels while a real bug (e.g. wrong weights or a
cross-sequence attention leak) moves log-probs by > 0.05.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.batches import left_padded_tensors
from megatron_rl.metrics import Metric
from tests.support.multirank import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks

PROMPT_LENS = [5, 2, 9, 3, 1]
RESPONSE_LENS = [4, 7, 1, 6, 2]
BF16_TOL = 2e-2


def _summed_loss(logprobs, entropy, mb, ctx):
    loss = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum")}


def _batch():
    from megatron_rl.data.batch import TrainingBatch

    t = left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, 128, torch.Generator().manual_seed(0), advantages=True)
    n = len(PROMPT_LENS)
    return TrainingBatch(t, list(range(n)), list(range(n)), [True] * n)


def _run(model_overrides: dict, full_state: dict | None, micro_batch_size: int = 8) -> dict:
    """forward logprobs, one forward_backward + optim_step (loss, grad norm), the updated full state."""
    from megatron_rl.config import BatchConfig, MegatronRLConfig, ModelConfig, OptimizerConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    config = MegatronRLConfig(
        model=ModelConfig(**model_overrides),
        optimizer=OptimizerConfig(lr=1e-3),
        batch=BatchConfig(micro_batch_size=micro_batch_size),
    )
    groups = initialize_distributed(config.parallel, seed=3)
    policy = MegatronPolicy(config, groups)
    if full_state is not None:
        dtype = next(policy.module.parameters()).dtype
        policy.load_full_state_dict({k: v.to(dtype) for k, v in full_state.items()})
    initial = {k: v.float().cpu() for k, v in policy.full_state_dict().items()}
    batch = _batch()
    logprobs = policy.forward(batch)["logprobs"].float().cpu()
    loss = policy.forward_backward(batch, _summed_loss, None)["loss"].final()
    step = policy.optim_step()
    return {"initial": initial, "logprobs": logprobs, "loss": loss, "grad_norm": step["grad_norm"],
            "device": str(groups.device)}


def _pair_child(rank: int, world_size: int, low: dict, micro_batch_size: int) -> dict:
    """fp32 reference and the ``low`` variant (same weights) in one process."""
    from megatron_rl.distributed.bootstrap import destroy_distributed

    reference = _run({}, None)
    destroy_distributed(keep_process_group=True)
    variant = _run(low, reference["initial"], micro_batch_size=micro_batch_size)
    return {"reference": reference, "variant": variant}


def _compare(result: dict, tol: float) -> None:
    mask = _batch()["response_mask"].bool()
    ref, var = result["reference"], result["variant"]
    diff = (ref["logprobs"] - var["logprobs"])[mask].abs().max().item()
    assert diff < tol, diff
    assert abs(ref["loss"] - var["loss"]) <= tol * max(1.0, abs(ref["loss"])), (ref["loss"], var["loss"])
    assert abs(ref["grad_norm"] - var["grad_norm"]) <= tol * ref["grad_norm"], (ref["grad_norm"], var["grad_norm"])


def test_bf16_policy_matches_fp32_on_cpu():
    """bf16 params/activations with fp32 logprobs and Megatron's fp32 main params, vs fp32 (module doc)."""
    result = run_ranks(1, _pair_child, {"params_dtype": "bfloat16"}, 8, timeout=300)[0]
    assert result["variant"]["device"] == "cpu"
    _compare(result, BF16_TOL)


# ---------------------------------------------------------------------- GPU (skipped without CUDA)


def _gpu_vs_cpu_child(rank: int, world_size: int, full_state: dict) -> dict:
    return _run({"attention_backend": "local"}, full_state)


@pytest.mark.gpu
def test_cuda_nccl_policy_matches_cpu_fp32():
    """NCCL bootstrap, model on CUDA, local THD attention, fp32 (no TF32): equals the CPU run to 1e-4."""
    cpu = run_ranks(1, _pair_child, {}, 8, timeout=300)[0]["reference"]
    gpu = run_ranks(1, _gpu_vs_cpu_child, cpu["initial"], timeout=300, cpu_only=False)[0]
    assert gpu["device"].startswith("cuda")
    _compare({"reference": cpu, "variant": gpu}, 1e-4)


@pytest.mark.gpu
def test_bf16_policy_matches_fp32_on_gpu():
    result = run_ranks(1, _pair_child, {"params_dtype": "bfloat16", "attention_backend": "local"}, 8,
                       timeout=300, cpu_only=False)[0]
    _compare(result, BF16_TOL)


def _te_child(rank: int, world_size: int) -> dict:
    """TE spec: packed micro-batches of several sequences vs one sequence per micro-batch (THD in TE)."""
    from megatron_rl.distributed.bootstrap import destroy_distributed

    packed = _run({"attention_backend": "te", "params_dtype": "bfloat16"}, None, micro_batch_size=8)
    destroy_distributed(keep_process_group=True)
    single = _run({"attention_backend": "te", "params_dtype": "bfloat16"}, None, micro_batch_size=1)
    return {"reference": single, "variant": packed}


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TransformerEngine")
def test_te_attention_packed_equals_one_sequence_per_pack():
    """TE's THD attention must not leak across packed sequences: same weights (same seed), bf16."""
    _compare(run_ranks(1, _te_child, timeout=300, cpu_only=False)[0], BF16_TOL)


def _weights_only_load_child(rank: int, world_size: int, ckpt_dir: str) -> float:
    """Save policy A, load its weights only into a differently initialized bf16 policy B, take one step at a
    negligible LR: B must stay at A's weights (its optimizer's fp32 main copies must follow the load)."""
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed

    from megatron_rl.model.policy import MegatronPolicy

    config = MegatronRLConfig(model=ModelConfig(params_dtype="bfloat16"), optimizer=OptimizerConfig(lr=1e-12))
    groups = initialize_distributed(config.parallel, seed=3)
    saved = MegatronPolicy(config, groups)
    save_checkpoint(saved, ckpt_dir, {"step": 1})
    torch.manual_seed(123)
    policy = MegatronPolicy(config, groups)  # other init
    for p in policy.module.parameters():
        p.data.add_(0.1)
    load_checkpoint(policy, ckpt_dir, load_optimizer=False)
    policy.forward_backward(_batch(), _summed_loss, None)
    policy.optim_step()
    after, reference = policy.full_state_dict(), saved.full_state_dict()
    return max((after[k].float() - reference[k].float()).abs().max().item() for k in reference)


def test_bf16_weights_only_checkpoint_load_survives_a_step(tmp_path):
    assert run_ranks(1, _weights_only_load_child, str(tmp_path), timeout=300)[0] < 1e-2
