"""Shared pieces of the context-parallel tests (run in spawned gloo children; module-level, importable).

The batch has rows of very different lengths: rows shorter than 2*cp tokens (2 and 3 tokens under CP2, where
a sequence is padded to 4 or 8), mid-sized rows and one long row, so the shorter rows carry heavy left padding.
The model is tiny (2 layers, hidden 32) so that 4-rank spawns stay fast on 2 cores.
"""

from __future__ import annotations


import torch

from tests.support.batches import full_grads, left_padded_tensors, max_rel_err, micro_batch_size, training_batch as make_batch  # noqa: F401
from megatron_rl.metrics import Metric

PROMPT_LENS = [1, 2, 9, 3, 30, 5, 1]
RESPONSE_LENS = [1, 1, 6, 11, 9, 2, 4]  # rows of 2, 3, 15, 14, 39, 7, 5 tokens
VOCAB = 64


def make_config(tp: int = 1, pp: int = 1, cp: int = 1, *, optimizer: str = "sgd", distributed: bool = False,
                sequence_parallel: bool = False):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                context_parallel_size=cp, sequence_parallel=sequence_parallel),
        model=ModelConfig(attention_backend="local", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB, max_position_embeddings=128),
        optimizer=OptimizerConfig(optimizer=optimizer, lr=0.05, clip_grad=0.0, use_distributed_optimizer=distributed),
        seed=1234,
    )


def batch_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, VOCAB, g, loss_drop=0.2, advantages=True)
    t["loss_mask"][0] = 1.0 * t["response_mask"][0]  # the 2-token row carries loss
    return t


def summed_pg_loss(logprobs, entropy, mb, loss_config):
    """Summed policy-gradient loss plus an entropy term (so the entropy gather's backward is exercised)."""
    mask = mb["loss_mask"]
    loss = -(logprobs * mb["advantages"] * mask).sum()
    if entropy is not None:
        loss = loss - 0.01 * (entropy * mask).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum"), "tokens": Metric(mask.sum(), 1.0, "sum")}


def init(cfg):
    """(Re)initialize megatron's parallel state for ``cfg`` in this process; the groups."""
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    if parallel_state.model_parallel_is_initialized():
        destroy_distributed(keep_process_group=True)
    return initialize_distributed(cfg.parallel, cfg.seed)


def fresh_policy(cfg, groups, full_sd=None):
    from megatron_rl.model.policy import MegatronPolicy

    policy = MegatronPolicy(cfg, groups)
    if full_sd is not None:
        policy.load_full_state_dict(full_sd)
    return policy


def grad_of(policy, batch, dp_size: int, count: int, *, entropy: bool = True) -> dict[str, torch.Tensor]:
    """Finalized gradient of the summed loss with ``count`` micro-batches per DP rank."""
    policy.config.batch.micro_batch_size = micro_batch_size(len(batch), dp_size, count)
    policy.forward_backward(batch, summed_pg_loss, None, compute_entropy=entropy)
    policy.finalize_grads()
    grads = full_grads(policy)
    policy.zero_grad()
    return grads


