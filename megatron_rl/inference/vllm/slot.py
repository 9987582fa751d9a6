"""One place in the fleet (``Slot``): the engine serving it now, its state, its restarts.

Place in the data flow: rank 0's ``Fleet`` (``fleet.py``) holds one per engine; its state moves starting ->
joining (up, waiting for the current weights) -> serving, or -> dead (marked down: a replacement starts, up to
``MAX_RESTARTS`` within one call).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from megatron_rl.inference.vllm.server import EngineServer

MAX_RESTARTS = 3
"""Restarts of one engine slot within one ``generate`` call before the job gives up on it."""

@dataclass
class Slot:
    """One place in the fleet: the engine serving it now, and its state."""

    index: int
    server: EngineServer | None = None
    state: str = "starting"
    """'starting' (process launched), 'joining' (up, waiting for the current weights), 'serving', 'dead'."""
    node: int = 0
    """The node that runs it (nodes.py); another node's engine is restarted by that node (``remote_restart``)."""
    remote_restart: bool = False
    """Down, on another node: its owner restarts it at the next collective point (``VLLMEngine._restart_remote``)."""
    generation: int = 0
    """How many engines this slot has had (its group prefix in the weight sync changes with each)."""
    restarts: int = 0
    restarter: threading.Thread | None = None
    error: str | None = None
    down_since: float | None = None
    """When it was marked down (``time.monotonic``), until a replacement serves: the "is back" line."""

    @property
    def prefix(self) -> str:
        return f"mrl/e{self.index}.{self.generation}"

    @property
    def name(self) -> str:
        where = self.server.log_path if self.server is not None and self.server.log_path else (
            self.server.url if self.server is not None else "-")
        return f"engine {self.index} ({where}{f' on node {self.node}' if self.node else ''})"
