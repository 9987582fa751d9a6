"""Where this ``run_megatron.sh`` starts its launcher: here, through srun on every node, or by submitting to Slurm.

Place in the data flow: the second step of ``run_megatron.sh`` (after ``job/paths.py`` chose the config files),
before the pre-flight and before torch is imported. ``python -m megatron_rl.launch.plan --config <file> ...
<overrides>`` prints shell code that ``run_megatron.sh`` evaluates; one of

    launch.scheduler=ray (also inside an allocation)  export NPROC; exec python -m megatron_rl.launch.ray_driver ...
    inside our srun step ($MEGATRON_RL_SLURM_STEP)    export NNODES=<SLURM_NNODES> NODE_RANK=<SLURM_NODEID>
                                                      (then the local launcher of this node, as on a laptop)
    inside an allocation ($SLURM_JOB_ID: salloc,      export MASTER_ADDR=<first node> MASTER_PORT=<from job id>
      sbatch, a user's script or ours)                exec srun --ntasks-per-node=1 ... bash run_megatron.sh ...
    launch.scheduler=slurm                            exec python -m megatron_rl.launch.submit ...
    local                                             (nothing, or export NNODES=<launch.nodes>)

A contradiction between the config, the environment and the allocation is one line on stderr and exit code 2,
before anything starts. The srun step runs ``run_megatron.sh`` with ``$MEGATRON_RL_SLURM_STEP`` set, so it takes
the srun-step branch and never calls srun again.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Mapping, Sequence

from megatron_rl.config_files import ConfigError, read_overrides
from megatron_rl.job.launch_config import LaunchConfig, launch_config_from_flat
from megatron_rl.job.paths import REPO_ROOT, caller_cwd
from megatron_rl.launch import slurm_env
from megatron_rl.launch.placement import engine_nodes_of, node_role
from megatron_rl.launch.slurm_cli import SlurmError, hostnames, node_address

LAUNCHER = REPO_ROOT / "run_megatron.sh"
STEP_WAIT_S = 120
SRUN_OPTIONS = ("--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--wait={STEP_WAIT_S}")
"""One launcher per node. When one node's launcher ends, the others get ``STEP_WAIT_S`` seconds to end too, then
srun ends them: a run stopped by a preemption signal exits 3 on every node after the checkpoint, and srun's exit
code (the highest of its tasks) stays 3 for the batch script (``--kill-on-bad-exit=1`` would kill the nodes still
finishing at the first exit 3: srun then reports 143). A crashed node's peers end at most ``STEP_WAIT_S`` later."""


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(config files, overrides)`` of ``--config A --config B key=value ...``."""
    configs, overrides, it = [], [], iter(argv)
    for arg in it:
        if arg == "--config":
            configs.append(next(it))
        else:
            overrides.append(arg)
    return configs, overrides


def exports(**values: object) -> str:
    return "export " + " ".join(f"{name}={shlex.quote(str(value))}" for name, value in values.items())


def in_step(env: Mapping[str, str]) -> list[str]:
    """This node's torchrun settings inside our srun step (and its ranks: the GPUs Slurm gave it)."""
    place = slurm_env.node_place(env)
    lines = [exports(NNODES=place.nnodes, NODE_RANK=place.node_rank)]
    gpus = slurm_env.gpus_per_node(env)
    if gpus and not env.get("NPROC"):
        lines.append(exports(NPROC=gpus))
    return lines


def srun_line(env: Mapping[str, str], launch: LaunchConfig, overrides: Sequence[str], workdir: Path) -> list[str]:
    """One launcher per node of the allocation, rendezvous on its first node."""
    alloc = slurm_env.allocation(env)
    slurm_env.check_nodes(alloc, launch.nodes, env)
    first = hostnames(alloc.nodelist)[0] if alloc.nodelist else "127.0.0.1"
    address = env.get("MASTER_ADDR") or node_address(first)
    port = slurm_env.master_port(env)
    srun = ["srun", f"--nodes={alloc.nnodes}", f"--ntasks={alloc.nnodes}", *SRUN_OPTIONS, f"--chdir={workdir}",
            "bash", str(LAUNCHER), *overrides]
    print(f"run_megatron.sh: Slurm job {alloc.job_id}: {alloc.nnodes} node(s) ({alloc.nodelist}), one launcher "
          f"per node with srun, rendezvous at {address}:{port}", file=sys.stderr)
    return [exports(**{slurm_env.STEP_ENV: 1, "MASTER_ADDR": address, "MASTER_PORT": port}), "exec " + shlex.join(srun)]


def local(env: Mapping[str, str], launch: LaunchConfig) -> list[str]:
    """Today's launch; ``launch.nodes`` sets ``NNODES`` (which must agree when given too)."""
    if launch.nodes is None:
        return []
    if env.get("NNODES") and env["NNODES"] != str(launch.nodes):
        raise slurm_env.SlurmContradiction(f"launch.nodes={launch.nodes} but NNODES={env['NNODES']}; set one of "
                                           "them")
    return [exports(NNODES=launch.nodes)]


def plan(env: Mapping[str, str], launch: LaunchConfig, argv: Sequence[str], engine_nodes: int = 0) -> list[str]:
    """The shell lines for ``run_megatron.sh`` (module docstring); with ``rollout.engine_nodes``, then this
    node's part: the trainer's ranks or the engine host (``launch/placement.py``)."""
    _, overrides = split_args(argv)
    if launch.scheduler == "ray":  # one actor per rank on the Ray cluster (launch/ray_driver.py); also a Ray
        # cluster started inside a Slurm allocation: Ray places the ranks, not srun
        return ["export NPROC", "exec " + shlex.join([sys.executable, "-m", "megatron_rl.launch.ray_driver", *argv])]
    if slurm_env.in_our_step(env):
        place = slurm_env.node_place(env)
        return in_step(env) + node_role(env, place.nnodes, place.node_rank, engine_nodes)
    if slurm_env.in_allocation(env):
        return srun_line(env, launch, overrides, caller_cwd())
    if launch.scheduler == "slurm":
        return ["exec " + shlex.join([sys.executable, "-m", "megatron_rl.launch.submit", *argv])]
    nnodes = launch.nodes if launch.nodes is not None else env.get("NNODES")
    return local(env, launch) + node_role(env, nnodes, env.get("NODE_RANK"), engine_nodes)


def load_flat(argv: Sequence[str]) -> dict:
    configs, overrides = split_args(argv)
    return read_overrides(configs, overrides)


def main(argv: Sequence[str]) -> int:
    try:
        flat = load_flat(argv)
        lines = plan(os.environ, launch_config_from_flat(flat), argv, engine_nodes_of(flat))
    except (ValueError, SlurmError) as err:  # ConfigError and SlurmContradiction are ValueErrors
        print(f"run_megatron.sh: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
