"""Where the ranks of a ``launch.scheduler=ray`` run go and what each gets: pure functions, no Ray import.

Place in the data flow: ``launch/ray_driver.py`` derives the ``Layout`` (nodes from ``launch.nodes``, ranks per node
from ``NPROC``, what each rank reserves from ``launch.ray``), ``launch/ray_run.py`` reserves its bundles and gives
each rank torchrun's variables (``Layout.rank_env``). Rank ``r`` is local rank ``r % NPROC`` of node
``r // NPROC``, torchrun's order; node ``n`` is bundle ``n`` of the placement group. With ``rollout.engine_nodes``
K the last K of ``launch.nodes`` are the fleet's own (``engine_bundles``): bundles ``nodes .. nodes + K - 1`` after
the trainer's, one engine host each (``launch/ray_engines.py``), no rank there (STRICT_SPREAD: every bundle on a
Ray node of its own). Without them, a vLLM fleet's engines run beside the ranks (``inference/nodes.py``) and their
CPUs are reserved in their node's bundle (``packed_cpus``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from megatron_rl.inference.nodes import check_engine_nodes, engines_on_node
from megatron_rl.job.launch_config import LaunchConfig
from megatron_rl.job.ray_launch_config import ENGINE_RESOURCE_SHARE
from megatron_rl.launch.placement import engine_nodes_of

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
    """The trainer's nodes (engine nodes not counted)."""
    nproc: int
    cpus_per_rank: float
    gpus_per_rank: float
    engine_bundles: tuple[dict[str, float], ...] = ()
    """``rollout.engine_nodes``: what each engine node's host reserves (its engines' CPUs and GPUs), in order."""
    packed_cpus: tuple[float, ...] = field(default=())
    """Without engine nodes: the CPUs of each trainer node's engines, reserved in its bundle (none: no fleet)."""

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    @property
    def all_nodes(self) -> int:
        return self.nodes + len(self.engine_bundles)

    def bundles(self) -> list[dict[str, float]]:
        """The trainer's nodes' bundles, then the engine nodes' (bundle ``n`` is node ``n``)."""
        bundles = []
        for node in range(self.nodes):
            bundle = {"CPU": self.nproc * self.cpus_per_rank + (self.packed_cpus[node] if self.packed_cpus else 0)}
            if self.gpus_per_rank:
                bundle["GPU"] = self.nproc * self.gpus_per_rank
            bundles.append(bundle)
        return bundles + [dict(bundle) for bundle in self.engine_bundles]

    @property
    def strategy(self) -> str:
        return "STRICT_SPREAD" if self.all_nodes > 1 else "PACK"

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


def layout_from(launch: LaunchConfig, env: Mapping[str, str], gpus_per_rank: float,
                flat: Mapping[str, Any] | None = None) -> Layout:
    """The run's layout; ``flat`` (the flat config) places a vLLM fleet (``engine_layout``)."""
    nproc = env.get("NPROC") or "2"
    if not nproc.isdigit() or int(nproc) < 1:
        raise RayLaunchError(f"run_megatron.sh: NPROC={nproc!r} must be a number of ranks per node >= 1")
    nodes = launch.nodes or int(env.get("NNODES") or 1)
    if launch.nodes and env.get("NNODES") and env["NNODES"] != str(launch.nodes):
        raise RayLaunchError(f"run_megatron.sh: launch.nodes={launch.nodes} but NNODES={env['NNODES']}; set one "
                             "of them")
    layout = Layout(nodes=nodes, nproc=int(nproc), cpus_per_rank=launch.ray.cpus_per_rank,
                    gpus_per_rank=gpus_per_rank)
    return engine_layout(layout, launch, flat or {})


def engine_layout(layout: Layout, launch: LaunchConfig, flat: Mapping[str, Any]) -> Layout:
    """``layout`` (all ``launch.nodes``) with the vLLM fleet's share: with ``rollout.engine_nodes`` K, its last K
    nodes as engine bundles (each: its engines x ``launch.ray.cpus_per_engine`` / ``gpus_per_engine``, and some of
    ``launch.ray.engine_node_resource`` when set: Ray places it on such a node); else the
    engines' CPUs in the bundle of the trainer node that starts them (``inference/nodes.py``'s rule)."""
    if flat.get("rollout.engine", "builtin") != "vllm":
        return layout
    engine_nodes, engines = engine_nodes_of(flat), int(flat.get("rollout.num_engines", 1))
    cpus = launch.ray.cpus_per_engine
    if not engine_nodes:
        return replace(layout, packed_cpus=tuple(len(engines_on_node(engines, n, layout.nodes)) * cpus
                                                 for n in range(layout.nodes)))
    try:
        check_engine_nodes(engine_nodes, engines, layout.nodes)
    except ValueError as err:
        raise RayLaunchError(f"run_megatron.sh: {err} (launch.nodes under launch.scheduler=ray)") from None
    trainer = layout.nodes - engine_nodes
    gpus = launch.ray.gpus_per_engine
    if gpus is None:  # an engine's devices on a GPU run: rollout.engine_tensor_parallel_size
        gpus = int(flat.get("rollout.engine_tensor_parallel_size", 1)) if layout.gpus_per_rank else 0
    bundles = []
    for node in range(trainer, layout.nodes):
        count = len(engines_on_node(engines, node, trainer, engine_nodes))
        bundle = {"CPU": count * cpus, **({"GPU": count * gpus} if gpus else {})}
        if launch.ray.engine_node_resource:
            bundle[launch.ray.engine_node_resource] = ENGINE_RESOURCE_SHARE
        bundles.append(bundle)
    return replace(layout, nodes=trainer, engine_bundles=tuple(bundles))


def gpus_per_rank(launch: LaunchConfig, device: str, cluster_gpus: float) -> float:
    """``launch.ray.gpus_per_rank``, else 0 for CPU ranks or a cluster without GPUs, else 1."""
    if launch.ray.gpus_per_rank is not None:
        return launch.ray.gpus_per_rank
    if device == "cuda" and not cluster_gpus:
        raise RayLaunchError("run_megatron.sh: parallel.device=cuda but the Ray cluster has no GPU; use "
                             "parallel.device=cpu, or add GPU nodes to the cluster")
    return 0 if device == "cpu" or not cluster_gpus else 1


def last_line(err: Exception) -> str:
    """The last line of a Ray error (its cause), short."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(err).__name__


def death_reason(err: Exception) -> str:
    """Ray's reason a dead actor gives, short: its first sentence that is not an id field, and the worker's exit
    type when given ("The actor is dead because its worker process has died (exit type SYSTEM_ERROR)")."""
    text = " ".join(line.strip() for line in str(err).splitlines()[1:] if line.strip() and not line.startswith("\t"))
    text = text or str(err).strip() or type(err).__name__
    reason = text.split(". ")[0].rstrip(".")
    kind = re.search(r"Worker exit type: (\w+)", text)
    return (reason + (f" (exit type {kind.group(1)})" if kind else ""))[:300]
