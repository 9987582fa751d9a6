"""The ``launch.ray`` sub-section of the job config: how ``launch.scheduler=ray`` uses the Ray cluster.

Place in the data flow: part of ``job/launch_config.py``'s ``LaunchConfig`` (read by ``megatron_rl/launch/plan.py``
and ``megatron_rl/launch/ray_driver.py`` before any rank starts; the ranks load it and do not act on it). Standard
library only: ``ray`` itself is imported by the driver alone.

    launch:
      scheduler: ray
      nodes: 2                    # one placement-group bundle per node (STRICT_SPREAD), NPROC ranks in each
      ray: {address: null, cpus_per_rank: 1, gpus_per_rank: null, cpus_per_engine: 1, gpus_per_engine: null,
            engine_node_resource: null, placement_timeout_s: 300}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.config_files import ConfigError

RAY_VERSION = "2.60.0"
"""The Ray release the ``ray`` extra pins (setup.py) and the tests run against."""
ENGINE_RESOURCE_SHARE = 0.001
"""What an engine node's bundle asks of ``launch.ray.engine_node_resource`` (any node that has it fits)."""
INSTALL_HINT = f"pip install 'ray=={RAY_VERSION}' (or the extra: pip install -e '.[ray]')"


@dataclass(kw_only=True)
class RayConfig:
    """Where ``launch.scheduler=ray`` runs the ranks: which cluster, and what each rank reserves there."""

    address: str | None = None
    """The cluster to join (``ray.init(address=...)``): None = ``$RAY_ADDRESS`` when set (``ray job submit``
    sets it), else 'auto' (the cluster this machine belongs to: ``ray start`` ran here). Never starts a cluster."""
    cpus_per_rank: float = 1
    """CPUs each trainer rank reserves in the placement group (``num_cpus`` of its actor)."""
    gpus_per_rank: float | None = None
    """GPUs each trainer rank reserves; None = 0 with ``parallel.device=cpu`` or a cluster without GPUs, else 1.
    Each rank sees the GPUs of its node's ranks (``CUDA_VISIBLE_DEVICES``), its own at index ``LOCAL_RANK``."""
    cpus_per_engine: float = 1
    """CPUs each vLLM engine (``rollout.engine=vllm``) reserves: in its engine node's bundle with
    ``rollout.engine_nodes`` (its engine host actor holds them), else in the bundle of the trainer node that starts
    it (``inference/nodes.py``: engine i on node i % nodes)."""
    gpus_per_engine: float | None = None
    """GPUs each engine on an engine node (``rollout.engine_nodes``) reserves; None = its
    ``rollout.engine_tensor_parallel_size`` when the ranks have GPUs, else 0. Engines beside the trainer share
    its nodes' GPUs, as under torchrun (no GPU reserved for them)."""
    engine_node_resource: str | None = None
    """With ``rollout.engine_nodes``: a custom resource of the Ray nodes meant for the engines (``ray start
    --resources='{"<name>": 1}'``, a KubeRay worker group's ``rayStartParams``); each engine node's bundle asks for
    ``ENGINE_RESOURCE_SHARE`` of it, so Ray places the engine nodes there. None: any Ray nodes other than the
    trainer's (STRICT_SPREAD: Ray picks which)."""
    placement_timeout_s: float = 300
    """Seconds to wait for the cluster to have room for the placement group (an autoscaler may be adding
    nodes); then one line saying what was asked and what the cluster has, exit code 2."""

    def validate(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ConfigError(f"launch.ray.address={self.address!r} must be a Ray address (host:port, "
                              "ray://host:10001, auto) or null")
        _check_number("launch.ray.cpus_per_rank", self.cpus_per_rank, positive=True)
        if self.gpus_per_rank is not None:
            _check_number("launch.ray.gpus_per_rank", self.gpus_per_rank, positive=False)
        if self.engine_node_resource is not None and (not isinstance(self.engine_node_resource, str)
                                                      or not self.engine_node_resource.strip()):
            raise ConfigError(f"launch.ray.engine_node_resource={self.engine_node_resource!r} must be the name of a "
                              "custom resource of the engine nodes (ray start --resources) or null")
        _check_number("launch.ray.cpus_per_engine", self.cpus_per_engine, positive=True)
        if self.gpus_per_engine is not None:
            _check_number("launch.ray.gpus_per_engine", self.gpus_per_engine, positive=False)
        _check_number("launch.ray.placement_timeout_s", self.placement_timeout_s, positive=True)


def _check_number(key: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        raise ConfigError(f"{key}={value!r} must be a number {'> 0' if positive else '>= 0'}")
