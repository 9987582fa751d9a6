"""``batch.max_tokens_per_micro_batch: auto``: a token budget per micro-batch from the model and the memory.

Fewer, fuller micro-batches cost less per token (one schedule pass, one kernel launch set per micro-batch: on the
small end a 4096-token budget took the update from 0.25 to 0.09 s against 4 rows per micro-batch, issue 53), and
the gradient does not depend on the split (docs/DESIGN.md section 5). A fixed budget is a hard cap that refuses a
longer sequence, so ``auto`` is resolved per call (``resolve``):

    budget = max(derived, the call's longest packed row)       never refuses a row
    derived = min(MAX_AUTO_TOKENS, MEMORY_FRACTION x free bytes / activation bytes per token), >= 1 packed align

``derive_budget`` runs once per policy (collective: the minimum over every rank, so every rank plans the same
micro-batches): free bytes are the device's free memory after the model and its optimizer are built, minus the
Adam state still to come (CUDA), or the host's available memory shared by the node's ranks (CPU).
``activation_bytes_per_token`` is an upper estimate of what one token keeps for the backward pass.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.microbatch import AUTO_TOKEN_BUDGET
from megatron_rl.distributed.bootstrap import ParallelGroups

logger = logging.getLogger("megatron_rl.model")

MAX_AUTO_TOKENS = 16384
"""The derived budget's ceiling: above it a micro-batch is no cheaper per token, only larger in memory."""
MEMORY_FRACTION = 0.25
"""Share of the free memory one micro-batch's activations may take (headroom for the allocator, logits peaks,
the pipeline's in-flight micro-batches and the rollouts)."""


def activation_bytes_per_token(config: MegatronRLConfig, tp_size: int) -> int:
    """Bytes one token keeps for the backward pass (an upper estimate): per layer ~18 hidden-sized and 4
    ffn-sized tensors (norms, QKV, attention output, MLP in/out, residuals), and ~4 fp32 vocabulary rows at the
    head (logits, log-softmax, its gradient, entropy); the ffn and the vocabulary are split over TP."""
    model = config.model
    width = 2 if model.params_dtype == "bfloat16" else 4
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    experts = model.moe_router_topk if model.num_moe_experts else 1
    per_layer = 18 * model.hidden_size + 4 * ffn * experts // tp_size
    return model.num_layers * per_layer * width + 4 * 4 * model.vocab_size // tp_size


def _free_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Memory this rank may use for activations: the GPU's free bytes less the Adam state to come, or the
    host's available bytes shared by the node's ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        return max(0, free - 8 * trainable)  # Adam's two fp32 moments, allocated at the first step
    import psutil

    return psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def derive_budget(config: MegatronRLConfig, groups: ParallelGroups, module: torch.nn.Module, align: int) -> int:
    """The derived budget of this job (collective over every rank: the minimum)."""
    per_token = activation_bytes_per_token(config, groups.tp_size)
    tokens = int(MEMORY_FRACTION * _free_bytes(module, groups.device) // per_token) * groups.cp_size
    budget = max(align, min(MAX_AUTO_TOKENS, tokens) // align * align)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor([budget], dtype=torch.long, device=groups.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        budget = int(agreed.item())
    logger.info("batch.max_tokens_per_micro_batch=auto: %d tokens (%d activation bytes per token; at least "
                "the longest sequence of each call)", budget, per_token)
    return budget


def resolve(setting: int | str | None, derived: int | None, packed_row_lengths: Sequence[int]) -> int | None:
    """The budget one call plans with: ``setting`` itself, or for ``"auto"`` the derived budget raised to the
    call's longest packed row."""
    if setting != AUTO_TOKEN_BUDGET:
        return setting
    assert derived is not None, "the policy derives the budget at construction (derive_budget)"
    return max(derived, max(packed_row_lengths, default=1))
