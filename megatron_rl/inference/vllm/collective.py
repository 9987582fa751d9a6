"""Small collectives of the vLLM engine over the trainer's ranks: rank 0's error raised everywhere, the nodes'
engine URLs gathered, a count summed, and whether an engine answers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.distributed.rank0 import broadcast_from_rank0
from megatron_rl.inference.engine import EngineError
from megatron_rl.inference.vllm.server import EngineDown, EngineServer


def gather_urls(own: dict[int, EngineServer]) -> dict[int, str]:
    """Collective: every node's engines (index -> URL), merged (for rank 0's ``Fleet``)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {i: server.url for i, server in own.items()})
    return {i: url for part in gathered for i, url in part.items()}


def sum_over_ranks(value: int, groups: Any) -> int:
    """Collective: ``value`` summed over the trainer's ranks (the senders' bytes; the others add 0)."""
    if groups.world_size == 1:
        return int(value)
    total = torch.tensor([value], dtype=torch.int64, device=groups.device)
    dist.all_reduce(total)
    return int(total.item())


def answers(server: EngineServer | None) -> bool:
    """Whether the engine answers ``/health`` now (it is alive)."""
    if server is None or not server.alive():
        return False
    try:
        server.call("GET", "/health", timeout_s=10)
        return True
    except (EngineDown, EngineError):
        return False


def raise_everywhere(error: str | None, kind: type[Exception]) -> None:
    """Rank 0's error (or None) on every rank, so every rank raises the same exception instead of hanging."""
    payload = broadcast_from_rank0([error])  # over this thread's group (distributed/rank0.py)
    if payload[0] is not None:
        raise kind(payload[0])
