"""``launch.scheduler=ray``: the run's ranks as Ray actors, one per rank, on the Ray cluster this command joins.

Place in the data flow: ``run_megatron.sh`` execs ``python -m megatron_rl.launch.ray_driver --config <file> ...
<overrides>`` when ``launch/plan.py`` says so (``NPROC`` exported: ranks per node). Then, in this process:

    pre-flight         megatron_rl.preflight with the job's loader, world size NPROC x launch.nodes (as torchrun's
                       launch runs it: exit 2 and one line when the run cannot start)
    join the cluster   ray.init(launch.ray.address | $RAY_ADDRESS | auto): never starts one
    placement group    one bundle per node {CPU: NPROC x cpus_per_rank, GPU: NPROC x gpus_per_rank}, STRICT_SPREAD
                       (each bundle on its own Ray node); waits launch.ray.placement_timeout_s for room; with
                       rollout.engine_nodes K the last K bundles are the engines' (``ray_layout.py``), one actor
                       each running the engine host there (``ray_engines.py``)
    one actor per rank megatron_rl-rank<N> (launch/ray_rank.py) in bundle GROUP_RANK; it starts
                       ``python -m megatron_rl.job.main <the same arguments>``, the entry point torchrun runs, with
                       torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
                       MASTER_ADDR/PORT = rank 0's node and a free port there) and the GPUs of its node's ranks
    supervise          prints the ranks' output as torchrun would (rank 0's progress), each rank's full log in
                       <logging.output_dir>/ray_logs/rank_<N>.log; ends as torchrun's launch does
                       (``distributed/launch.py``): a rank's reported line once, with its exit code

A dead rank actor (killed, its node gone) ends the run with one line naming the rank and node (exit code 1);
Ctrl-C (or SIGTERM: ``ray job stop``) passes SIGINT to every rank, which stops at a step boundary as under
torchrun (a second Ctrl-C ends them at once). ``ray job stop`` SIGKILLs this process ``RAY_JOB_STOP_WAIT_TIME_S``
after its SIGTERM (Ray's default 3 s, set at submission: docs/RAY.md); then Ray ends the actors, as below. Every actor ends with this process: none is detached (Ray ends an
owner's actors with it), and each rank dies with its actor (``ray_rank.py``). Same job, same results as torchrun:
everything after the ranks start is the code torchrun runs.

Every node runs the ranks from the same paths as this one (the checkout, the venv, the output folder): a shared
file system or identical images, as for Slurm (docs/CLUSTER.md).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.config_files import ConfigError, read_overrides
from megatron_rl.job.launch_config import launch_config_from_flat
from megatron_rl.job.ray_launch_config import INSTALL_HINT
from megatron_rl.launch.plan import split_args
from megatron_rl.launch.ray_layout import LOG_DIR, RayLaunchError, forwarded_env, gpus_per_rank, layout_from
from megatron_rl.launch.ray_run import RayRun
from megatron_rl.launch.submit import output_dir

CONNECT_TIMEOUT_S = 5.0


def preflight(argv: Sequence[str], world: int) -> int:
    """The pre-flight ``job/start.py`` runs beside torchrun, here before the actors (exit 2 and one line when the
    run cannot start)."""
    from megatron_rl.job.preflight import load_job_rl_config
    from megatron_rl.preflight import main as preflight_main

    configs, overrides = split_args(argv)
    return preflight_main([*(a for c in configs for a in ("--config", c)), "--world-size", str(world), *overrides],
                          load=load_job_rl_config)


def connect(address: str | None) -> Any:
    """``ray`` joined to the cluster (a missing package or cluster: RayLaunchError)."""
    try:
        import ray
    except ImportError:
        raise RayLaunchError(f"run_megatron.sh: launch.scheduler=ray needs the ray package, not installed in "
                             f"{sys.prefix}: {INSTALL_HINT}") from None
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    unreachable = refused(where)
    if unreachable:
        raise RayLaunchError(f"run_megatron.sh: launch.scheduler=ray: no Ray cluster at {where} ({unreachable}); "
                             "start one (ray start --head) or set RAY_ADDRESS or launch.ray.address")
    try:
        ray.init(address=where, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RayLaunchError(f"run_megatron.sh: launch.scheduler=ray: no Ray cluster at {where} "
                             f"({str(err).splitlines()[0]}); start one (ray start --head) or set RAY_ADDRESS or "
                             "launch.ray.address") from None
    return ray


def refused(address: str) -> str | None:
    """Why a ``host:port`` address takes no connection (None: it does, or another form: auto, ray://, http://).
    ``ray.init`` would retry a dead address for minutes."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def main(argv: Sequence[str]) -> int:
    try:
        return start(argv)
    except KeyboardInterrupt:  # before the ranks started (the run's own Ctrl-C: RayRun.interrupted)
        return 130


def start(argv: Sequence[str]) -> int:
    configs, overrides = split_args(argv)
    try:
        flat = read_overrides(configs, overrides)
        launch = launch_config_from_flat(flat)
        ray = connect(launch.ray.address)
        resources = ray.cluster_resources()
        device = str(flat.get("parallel.device") or "auto")
        layout = layout_from(launch, os.environ, gpus_per_rank(launch, device, resources.get("GPU", 0)), flat)
    except ConfigError as err:
        print(f"run_megatron.sh: {err}", file=sys.stderr, flush=True)
        return 2
    except RayLaunchError as err:
        print(err, file=sys.stderr, flush=True)
        return err.code
    engine_nodes = len(layout.engine_bundles)
    print(f"run_megatron.sh: {layout.nproc} process(es) per node x {layout.nodes} node(s)"
          + (f" + {engine_nodes} engine node(s) (rollout.engine_nodes)" if engine_nodes else "")
          + f" on the Ray cluster ({resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU), config "
          f"{' '.join(configs)}"
          + (f", overrides: {' '.join(overrides)}" if overrides else ""), flush=True)
    code = preflight(argv, layout.world)
    if code:
        return code
    run = RayRun(ray, layout, launch, argv, Path(output_dir(flat)) / LOG_DIR, forwarded_env(os.environ))
    signal.signal(signal.SIGTERM, _interrupt)  # ray job stop: as Ctrl-C
    return run.run()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
