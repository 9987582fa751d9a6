"""Where the job's engines run on a multi-node torchrun job: which node starts which engine, and on what address.

Place in the data flow: ``vllm/engine.py: VLLMEngine.start`` reads the torchrun layout (``NodeLayout.from_env``) once;
every node's local rank 0 starts the engines ``engines_on_node`` gives its node (``vllm/launcher.py: Launcher.launch``),
bound to ``engine_host``; global rank 0's ``Fleet`` routes over all of them.

The rule (deterministic, the same on every rank): **engine i runs on node i % nnodes** (round-robin, so
``rollout.num_engines=2`` on two nodes is one engine per node); on its node it is the ``i // nnodes``-th engine
and, on GPUs, takes that node's local devices ``(i // nnodes) * tp ...`` (``tp`` =
``rollout.engine_tensor_parallel_size``). With ``rollout.engine_nodes`` K > 0 the fleet has nodes of its own:
``nnodes`` trainer nodes (torchrun's, numbered first) run no engine, and engine i runs on engine node
``nnodes + i % K``, started by that node's engine host (``inference/vllm/engine_host.py``, not a torchrun rank). A single-node job binds its engines to loopback; a multi-node job binds
them to ``rollout.engine_host`` ("auto": the local interface that routes to ``MASTER_ADDR``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class NodeLayout:
    """This process's place among torchrun's nodes."""

    node: int = 0
    nnodes: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "NodeLayout":
        """torchrun's ``GROUP_RANK`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (a process without them: one node)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        rank = int(os.environ.get("RANK", "0"))
        nnodes = max(1, world // max(1, local_world))
        node = int(os.environ.get("GROUP_RANK", str(rank // max(1, local_world))))
        return cls(node=node, nnodes=nnodes, local_rank=int(os.environ.get("LOCAL_RANK", str(rank % max(1, local_world)))))

    @property
    def owner(self) -> bool:
        """True on the process that starts (and restarts) this node's engines: its local rank 0."""
        return self.local_rank == 0


def engine_node(index: int, nnodes: int, engine_nodes: int = 0) -> int:
    """The node that runs engine ``index`` (module docstring: round-robin over the trainer's ``nnodes`` nodes, or
    over the ``engine_nodes`` nodes after them)."""
    return nnodes + index % engine_nodes if engine_nodes else index % nnodes


def engines_on_node(num_engines: int, node: int, nnodes: int, engine_nodes: int = 0) -> list[int]:
    """The indices of the engines ``node`` starts, in order (its position in this list picks its devices)."""
    return [i for i in range(num_engines) if engine_node(i, nnodes, engine_nodes) == node]


def check_engine_nodes(engine_nodes: int, num_engines: int, all_nodes: int) -> None:
    """``rollout.engine_nodes`` fits the job: fewer than its nodes (the trainer needs one), at most one per engine.
    ValueError naming the key and the fix (before anything starts: ``run_megatron.sh``, the engine host)."""
    if engine_nodes and engine_nodes >= all_nodes:
        raise ValueError(f"rollout.engine_nodes={engine_nodes} but the job has {all_nodes} node(s) (NNODES): the "
                         f"trainer needs at least one; use NNODES >= {engine_nodes + 1} or fewer engine nodes")
    if engine_nodes > num_engines:
        raise ValueError(f"rollout.engine_nodes={engine_nodes} but rollout.num_engines={num_engines}: an engine node "
                         f"would run no engine; set rollout.num_engines >= {engine_nodes} (a multiple spreads them "
                         "evenly) or fewer engine nodes")


def engine_host(setting: str, nnodes: int, master_addr: str | None = None) -> str:
    """The address this node's engines bind to: loopback on one node; else ``setting`` (``rollout.engine_host``),
    where "auto" is the local address of the interface that routes to ``master_addr`` (``$MASTER_ADDR``)."""
    if nnodes <= 1:
        return LOOPBACK
    if setting != "auto":
        return setting
    target = master_addr or os.environ.get("MASTER_ADDR", LOOPBACK)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # a UDP connect sends nothing: it only routes
        try:
            sock.connect((target, 9))
        except OSError as err:
            raise ValueError(f"rollout.engine_host=auto: no route to MASTER_ADDR={target!r} ({err}); set "
                             "rollout.engine_host to an address of this node that global rank 0 can reach") from None
        return sock.getsockname()[0]
