"""What Slurm already knows, read from its environment variables: node count, node rank, rendezvous, GPUs.

Place in the data flow: ``launch/plan.py`` calls these inside an allocation, once in the batch script (or the
user's salloc shell) to build the ``srun`` line, and once per node inside the step to set torchrun's
``NNODES``/``NODE_RANK``. Pure functions of a mapping of variables (no subprocess), so the derivation is tested
without a cluster (tests/cluster/test_slurm_env.py).

    salloc/sbatch shell        SLURM_JOB_ID, SLURM_JOB_NUM_NODES (SLURM_NNODES), SLURM_JOB_NODELIST
      srun, one task per node  + SLURM_NODEID (0..N-1), SLURM_STEP_ID, SLURM_GPUS_ON_NODE (with a GPU request)
        run_megatron.sh        NNODES = SLURM_NNODES, NODE_RANK = SLURM_NODEID, MASTER_ADDR = the first node
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

STEP_ENV = "MEGATRON_RL_SLURM_STEP"
"""Set on the srun step our launch starts: ``run_megatron.sh`` there runs the local launcher, never srun again."""
PORT_BASE, PORT_SPAN = 20000, 20000
"""A job's default rendezvous port is ``PORT_BASE + job id % PORT_SPAN``: every node computes the same one, and
two jobs sharing a node rarely collide (``MASTER_PORT`` overrides it)."""


class SlurmContradiction(ValueError):
    """A setting that contradicts the allocation (one line; the launch exits 2 before anything starts)."""


@dataclass(frozen=True)
class Allocation:
    """The allocation this process runs in."""

    job_id: str
    nnodes: int
    nodelist: str
    """Slurm's compressed form (``node[01-04]``); ``scontrol show hostnames`` expands it."""


@dataclass(frozen=True)
class NodePlace:
    """torchrun's multi-node settings of one node of the step."""

    nnodes: int
    node_rank: int


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def in_our_step(env: Mapping[str, str]) -> bool:
    """True inside the srun step our own launch started (the recursion guard)."""
    return bool(env.get(STEP_ENV)) and in_allocation(env)


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    if not value.isdigit():
        raise SlurmContradiction(f"${name}={value!r} inside a Slurm allocation: expected a number (is this shell "
                                 "inside salloc/sbatch?)")
    return int(value)


def allocation(env: Mapping[str, str]) -> Allocation:
    """The allocation of ``env`` (``SLURM_JOB_NUM_NODES``, else the older ``SLURM_NNODES``)."""
    name = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
    return Allocation(job_id=env["SLURM_JOB_ID"], nnodes=_int(env, name), nodelist=env.get("SLURM_JOB_NODELIST", ""))


def check_nodes(alloc: Allocation, nodes: int | None, env: Mapping[str, str]) -> None:
    """``launch.nodes`` and ``$NNODES``, when given, must equal the allocation's node count."""
    if nodes is not None and nodes != alloc.nnodes:
        raise SlurmContradiction(f"launch.nodes={nodes} but this Slurm allocation (job {alloc.job_id}) has "
                                 f"{alloc.nnodes} node(s); remove launch.nodes (it is derived) or ask Slurm for "
                                 f"{nodes} (sbatch/salloc --nodes={nodes})")
    given = env.get("NNODES")
    if given and given != str(alloc.nnodes):
        raise SlurmContradiction(f"NNODES={given} but this Slurm allocation (job {alloc.job_id}) has "
                                 f"{alloc.nnodes} node(s); unset NNODES (it is derived from Slurm)")


def node_place(env: Mapping[str, str]) -> NodePlace:
    """This node's place in our srun step (one task per node): rank ``SLURM_NODEID`` of ``SLURM_NNODES``."""
    nnodes, node_rank = _int(env, "SLURM_NNODES"), _int(env, "SLURM_NODEID")
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if tasks and tasks != str(nnodes):
        raise SlurmContradiction(f"the srun step has {tasks} tasks on {nnodes} node(s); run_megatron.sh needs one "
                                 "task per node (srun --ntasks-per-node=1; it starts the ranks of its node itself)")
    if not 0 <= node_rank < nnodes:
        raise SlurmContradiction(f"SLURM_NODEID={node_rank} is not below SLURM_NNODES={nnodes}")
    return NodePlace(nnodes=nnodes, node_rank=node_rank)


def master_port(env: Mapping[str, str]) -> int:
    """``$MASTER_PORT`` when set, else one derived from the job id (the same on every node)."""
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    return PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN


def gpus_per_node(env: Mapping[str, str]) -> int | None:
    """The GPUs Slurm gave this node (``SLURM_GPUS_ON_NODE``), or None without a GPU request."""
    value = env.get("SLURM_GPUS_ON_NODE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None
