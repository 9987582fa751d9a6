"""Shared pieces of the LoRA tests (importable from spawned children: they inherit sys.path)."""

from __future__ import annotations

import torch

from tests.support.batches import full_grads


def randomize_adapters(module: torch.nn.Module, seed: int, rank: int) -> None:
    """Draw every local A and B from N(0, 0.3 / sqrt(r)) (B is zero at init, where A gets no gradient), so that
    the adapters matter. For a single-process model only: shards of a larger layout would draw differently."""
    from megatron_rl.model.lora import adapter_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in adapter_parameters(module):
            param.copy_(torch.randn(param.shape, generator=g) * 0.3 / rank**0.5)


def adapters_only(full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron_rl.model.lora import is_adapter_name

    return {k: v for k, v in full_sd.items() if is_adapter_name(k)}


def adapter_grads(policy) -> dict[str, torch.Tensor]:
    """Finalized gradients of the adapters in the single-process layout (the base has none)."""
    return adapters_only(full_grads(policy))
