"""Where the ranks of a ``launch.scheduler=ray`` run go and what each gets: pure functions, no Ray import.

Place in the data flow: ``launch/ray_driver.py`` derives the ``Layout`` (nodes from ``launch.nodes``, ranks per node
from ``NPROC``, what each rank reserves from ``launch.ray``), ``launch/ray_run.py`` reserves its bundles and gives
each rank torchrun's variables (``Layout.rank_env``). Rank ``r`` is local rank ``r % NPROC`` of node
``r // NPROC``, torchrun's order; node ``n`` is bundle ``n`` of the placement group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_rl.job.launch_config import LaunchConfig

POLL_S = 0.5
LOG_DIR = "ray_logs"
"""Each rank's full log: ``<logging.output_dir>/ray_logs/rank_<N>.log``."""
ACTOR_NAME = "megatron_rl-rank{rank}"
FORWARDED_ENV = ("MEGATRON_RL_", "OMP_", "MKL_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_",
                 "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "TRITON_", "CUDA_LAUNCH_BLOCKING", "WANDB_", "PYTHONPATH",
                 "PYTHONHASHSEED")
"""This process's variables (names starting so) the ranks get, over their node's own environment (under torchrun
the ranks inherit the whole launcher's; on another node only these carry over)."""
FAILURE_GRACE_S = 5.0
"""After a rank fails, the others get this long to end on their own (and report) before they are stopped."""
STOP_GRACE_S = 10.0
"""SIGTERM, then SIGKILL after this long."""
INTERRUPT_GRACE_S = 120.0
"""After Ctrl-C the ranks get this long to stop at a step boundary (a second Ctrl-C: at once)."""


class RayLaunchError(Exception):
    """A reason the run cannot start or went on no longer (one line; the exit code)."""

    def __init__(self, line: str, code: int = 2) -> None:
        super().__init__(line)
        self.code = code


@dataclass(frozen=True)
class Layout:
    """The ranks of the run on the cluster's nodes: rank = node x nproc + local rank (torchrun's order)."""

    nodes: int
    nproc: int
    cpus_per_rank: float
    gpus_per_rank: float

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.nproc * self.cpus_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = self.nproc * self.gpus_per_rank
        return [dict(bundle) for _ in range(self.nodes)]

    @property
    def strategy(self) -> str:
        return "STRICT_SPREAD" if self.nodes > 1 else "PACK"

    def rank_env(self, rank: int, master_addr: str, master_port: int, visible: str) -> dict[str, str]:
        """torchrun's variables for ``rank`` (``visible``: the GPUs of its node's ranks, '' for none)."""
        node, local = divmod(rank, self.nproc)
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(self.nodes),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port), "CUDA_VISIBLE_DEVICES": visible}


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    carried = {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV)}
    return {"OMP_NUM_THREADS": "1", **carried}  # run_megatron.sh's default


def visible_devices(places: Sequence[dict[str, Any]], layout: Layout, node: int) -> str:
    """The GPUs Ray gave the ranks of ``node``, in local-rank order (a rank uses index ``LOCAL_RANK``)."""
    ids: list[str] = []
    for place in places[node * layout.nproc:(node + 1) * layout.nproc]:
        ids += [g for g in place["gpus"] if g not in ids]
    return ",".join(ids)


def layout_from(launch: LaunchConfig, env: Mapping[str, str], gpus_per_rank: float) -> Layout:
    nproc = env.get("NPROC") or "2"
    if not nproc.isdigit() or int(nproc) < 1:
        raise RayLaunchError(f"run_megatron.sh: NPROC={nproc!r} must be a number of ranks per node >= 1")
    nodes = launch.nodes or int(env.get("NNODES") or 1)
    if launch.nodes and env.get("NNODES") and env["NNODES"] != str(launch.nodes):
        raise RayLaunchError(f"run_megatron.sh: launch.nodes={launch.nodes} but NNODES={env['NNODES']}; set one "
                             "of them")
    return Layout(nodes=nodes, nproc=int(nproc), cpus_per_rank=launch.ray.cpus_per_rank, gpus_per_rank=gpus_per_rank)


def gpus_per_rank(launch: LaunchConfig, device: str, cluster_gpus: float) -> float:
    """``launch.ray.gpus_per_rank``, else 0 for CPU ranks or a cluster without GPUs, else 1."""
    if launch.ray.gpus_per_rank is not None:
        return launch.ray.gpus_per_rank
    if device == "cuda" and not cluster_gpus:
        raise RayLaunchError("run_megatron.sh: parallel.device=cuda but the Ray cluster has no GPU; use "
                             "parallel.device=cpu, or add GPU nodes to the cluster")
    return 0 if device == "cpu" or not cluster_gpus else 1
