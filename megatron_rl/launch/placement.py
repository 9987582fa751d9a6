"""Which part of the job this node's ``run_megatron.sh`` runs with ``rollout.engine_nodes=K``: the trainer's
ranks (torchrun over the first ``NNODES - K`` nodes) or, on the last K nodes, the engine host
(``inference/vllm/engine_host.py``) that starts the fleet's engines there and no trainer rank.

Place in the data flow: part of ``launch/plan.py``'s shell lines, after the node count and rank are known (from
``NNODES``/``NODE_RANK``, ``launch.nodes`` or Slurm). The placement rule itself is ``inference/nodes.py``'s.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, Mapping

from megatron_rl.config_files import ConfigError
from megatron_rl.inference.nodes import check_engine_nodes

DEFAULT_MASTER_PORT = 29500
"""The port every node agrees on when none is given (torchrun's nodes and the engine hosts share it)."""


def engine_nodes_of(flat: Mapping[str, Any]) -> int:
    """``rollout.engine_nodes`` from the flat config (``config_files.read_overrides``); 0 when unset."""
    value = flat.get("rollout.engine_nodes", 0) or 0
    if isinstance(value, bool) or not str(value).isdigit():
        raise ConfigError(f"rollout.engine_nodes={value!r} is not a whole number of nodes (0 = beside the trainer)")
    return int(value)


def node_role(env: Mapping[str, str], nnodes: Any, node_rank: Any, engine_nodes: int) -> list[str]:
    """Shell lines: nothing without engine nodes; on an engine node, the engine host instead of torchrun; on a
    trainer node, ``NNODES`` = the trainer's nodes (its world size and DP). ValueError naming the fix."""
    if not engine_nodes:
        return []
    nnodes, node_rank = str(nnodes or 1), str(node_rank or 0)
    if not (nnodes.isdigit() and node_rank.isdigit()) or env.get("RDZV_ENDPOINT"):
        raise ValueError(f"rollout.engine_nodes={engine_nodes} needs NNODES and NODE_RANK as numbers, and "
                         "MASTER_ADDR/MASTER_PORT rather than RDZV_ENDPOINT (each node must know whether it is an "
                         "engine node)")
    nnodes_n, rank = int(nnodes), int(node_rank)
    check_engine_nodes(engine_nodes, engine_nodes, all_nodes=nnodes_n)  # (the engine count: the engine host's check)
    port = env.get("MASTER_PORT") or DEFAULT_MASTER_PORT  # shared with the engine nodes, never a free one
    if rank >= nnodes_n - engine_nodes:
        host = [sys.executable, "-m", "megatron_rl.inference.vllm.engine_host", "--nodes", nnodes,
                "--engine-nodes", str(engine_nodes), "--node-rank", node_rank]
        say = (f"run_megatron.sh: node {rank} of {nnodes_n} is an engine node (rollout.engine_nodes={engine_nodes}): "
               "it runs the fleet's engines, no trainer rank")
        return [f"echo {shlex.quote(say)}", _exports(MASTER_ADDR=env.get("MASTER_ADDR") or "127.0.0.1",
                                                     MASTER_PORT=port), "exec " + shlex.join(host)]
    return [_exports(NNODES=nnodes_n - engine_nodes, NODE_RANK=rank, MASTER_PORT=port)]


def _exports(**values: object) -> str:
    return "export " + " ".join(f"{name}={shlex.quote(str(value))}" for name, value in values.items())
