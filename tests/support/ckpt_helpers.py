"""Shared pieces of the checkpoint tests (imported by spawned ranks and by the crash worker script).

A tiny policy (2 layers, hidden 64, vocab 128) with Adam, LR warmup + linear decay (so a resume without the
scheduler state shows), a fixed left-padded batch and a summed policy-gradient loss.
"""

from __future__ import annotations

import torch

LR = 0.01


def make_config(tp: int = 1, pp: int = 1, *, distributed: bool = False, optimizer: str = "adam", hidden: int = 64,
                keep_last: int = 2, timeout_s: float = 120.0):
    from megatron_rl.config import CheckpointConfig, MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        model=ModelConfig(attention_backend="local", hidden_size=hidden),
        optimizer=OptimizerConfig(
            optimizer=optimizer, lr=LR, clip_grad=1.0, use_distributed_optimizer=distributed,
            lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=10, min_lr=LR / 10,
        ),
        checkpoint=CheckpointConfig(keep_last=keep_last, save_timeout_s=timeout_s),
        seed=11,
    )  # fmt: skip


def make_batch(vocab: int = 128, seed: int = 0):
    """4 left-padded rows [B, S] with right-aligned responses [B, R] (docs/DESIGN.md section 2)."""
    from tests.support.batches import left_padded_tensors

    from megatron_rl.data.batch import TrainingBatch

    t = left_padded_tensors([3, 6, 2, 5], [4, 2, 5, 3], vocab, torch.Generator().manual_seed(seed), advantages=True)
    rows = len(t["sequences"])
    return TrainingBatch(t, list(range(rows)), list(range(rows)), [True] * rows)


def train_step(policy, batch) -> dict[str, float]:
    """One optimizer step on ``batch``: ``{"loss", "grad_norm", "lr"}``."""
    metrics = policy.forward_backward(batch, summed_pg_loss, None)
    stats = policy.optim_step()
    return {"loss": metrics["loss"].final(), **stats}


def full_weights(policy) -> dict[str, torch.Tensor]:
    """TP/PP-unsharded weights (identical keys under every layout; collective)."""
    return {k: v.detach().clone() for k, v in policy.full_state_dict().items()}


def set_weights_to_step(policy, base: dict[str, torch.Tensor], step: int) -> None:
    """Make every local parameter ``base + step`` (a state whose step can be read back from the weights)."""
    with torch.no_grad():
        for name, param in policy.module.named_parameters():
            param.copy_(base[name] + step)


def local_weights(policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.module.named_parameters()}


def summed_pg_loss(logprobs, entropy, mb, loss_config):
    """``batches.summed_pg_loss``, imported when called."""
    from tests.support.batches import summed_pg_loss as loss_fn

    return loss_fn(logprobs, entropy, mb, loss_config)
