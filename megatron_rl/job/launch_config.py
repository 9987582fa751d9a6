"""The ``launch`` section of the job config: where the run's launchers start (this machine, or Slurm).

Place in the data flow: read by ``megatron_rl/launch/plan.py`` at the very start of ``run_megatron.sh``, before
the pre-flight and before torch is imported (this module needs the standard library and ``config_files`` only);
the ranks load it with the rest of the job config (``job/config.py``) and do not act on it.

    launch:
      scheduler: local          # local: torchrun here (NNODES/NODE_RANK by hand); slurm: sbatch from here
      nodes: null               # null: 1 locally, the allocation's node count inside Slurm
      follow: true              # slurm: print the job's log until it ends
      slurm: {partition: null, account: null, time: null, gpus_per_node: null, cpus_per_task: null,
              extra: [], requeue: false, signal_s: 120}
      ray: {address: null, cpus_per_rank: 1, gpus_per_rank: null, placement_timeout_s: 300}  # scheduler: ray

Inside a Slurm allocation (``$SLURM_JOB_ID`` set) the launch always runs through ``srun`` whatever
``launch.scheduler`` says: the node count, node rank and master address are Slurm's (docs/CLUSTER.md).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from megatron_rl.config_files import ConfigError
from megatron_rl.job.ray_launch_config import RayConfig

SCHEDULERS = ("local", "slurm", "ray")
TIME_FORMAT = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^\d+-\d+$")
"""Slurm's ``--time`` forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""


@dataclass(kw_only=True)
class SlurmConfig:
    """How ``launch.scheduler=slurm`` asks Slurm for the allocation (the ``#SBATCH`` lines of the batch script)."""

    partition: str | None = None
    """``--partition``; None = the cluster's default partition."""
    account: str | None = None
    """``--account`` to charge; None = your default account."""
    time: str | int | None = None
    """``--time`` limit as Slurm's days-hours form ``D-HH:MM:SS`` (``0-04:00:00``, ``1-12:00:00``); None = the
    partition's default. YAML reads ``4:00:00`` and ``30`` as numbers (base 60), so those forms are refused with
    this fix; in a YAML file a quoted ``'4:00:00'`` works too.
    A job stopped by its time limit after saving a checkpoint says so and prints the command that continues it."""
    gpus_per_node: int | None = None
    """``--gpus-per-node``; None = no GPU request (a CPU run, or a cluster that gives nodes whole). Inside the
    allocation the ranks per node follow ``$SLURM_GPUS_ON_NODE`` unless ``NPROC`` is set."""
    cpus_per_task: int | None = None
    """``--cpus-per-task`` of the one launcher task per node (its ranks share them); None = Slurm's default."""
    extra: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, one per item, written as given (``--qos=high``, ``--exclusive``,
    ``--constraint=h100``); the leading ``#SBATCH`` may be left out."""
    requeue: bool = False
    """On a preemption or time-limit signal the job saves a checkpoint and exits with code 3; with true the batch
    script then requeues it (``scontrol requeue``; ``--requeue``) and the requeued job resumes from that
    checkpoint. With false it ends and prints the command that continues it."""
    signal_s: int = 120
    """Seconds before the time limit at which Slurm sends SIGUSR1 to the batch script (``--signal=B:USR1@<s>``),
    which forwards it to the launchers so they checkpoint at the next step boundary; 0 = no early signal. Leave
    room for one step and one checkpoint save."""

    def validate(self) -> None:
        if isinstance(self.time, int) and not isinstance(self.time, bool):
            raise ConfigError(f"launch.slurm.time={self.time!r} was read as a number (YAML reads 4:00:00 and 30 as "
                              "numbers); write it as D-HH:MM:SS, e.g. launch.slurm.time=0-04:00:00")
        for key in ("partition", "account", "time"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip() or "\n" in value):
                raise ConfigError(f"launch.slurm.{key}={value!r} must be a non-empty string on one line, or null")
        if self.time is not None and not TIME_FORMAT.match(self.time.strip()):
            raise ConfigError(f"launch.slurm.time={self.time!r} is not a Slurm time limit; write minutes (30), "
                              "HH:MM:SS (4:00:00) or D-HH:MM:SS (1-12:00:00)")
        for key in ("gpus_per_node", "cpus_per_task"):
            _check_int(f"launch.slurm.{key}", getattr(self, key), low=1, optional=True)
        _check_int("launch.slurm.signal_s", self.signal_s, low=0, optional=False)
        _check_bool("launch.slurm.requeue", self.requeue)
        if not isinstance(self.extra, list) or not all(isinstance(x, str) and x.strip() and "\n" not in x
                                                        for x in self.extra):
            raise ConfigError(f"launch.slurm.extra={self.extra!r} must be a list of #SBATCH options, one string "
                              "each (e.g. ['--qos=high', '--exclusive'])")

    def sbatch_options(self) -> list[str]:
        """The options these settings add to the batch script (``--partition=...``), in a fixed order."""
        options = [f"--{name.replace('_', '-')}={getattr(self, name)}"
                   for name in ("partition", "account", "time", "gpus_per_node", "cpus_per_task")
                   if getattr(self, name) is not None]
        if self.requeue:
            options.append("--requeue")
        if self.signal_s:
            options.append(f"--signal=B:USR1@{self.signal_s}")
        return options + [x.strip().removeprefix("#SBATCH").strip() for x in self.extra]


@dataclass(kw_only=True)
class LaunchConfig:
    """Where the run starts: on this machine (``local``, today's launch) or submitted to Slurm (``slurm``)."""

    scheduler: Literal["local", "slurm", "ray"] = "local"
    """'local': torchrun on this machine (several machines: ``NNODES``/``NODE_RANK``/``MASTER_ADDR`` on each);
    'slurm': write a batch script into ``logging.output_dir`` and submit it with sbatch. Inside an allocation
    (``$SLURM_JOB_ID`` set) the run goes through srun either way. 'ray': one actor per rank on the Ray cluster
    (``launch.ray``; ``megatron_rl/launch/ray_driver.py``, docs/CLUSTER.md)."""
    nodes: int | None = None
    """Nodes of the run; None = derived (1 locally, ``$NNODES`` when set; inside an allocation, its node count).
    Inside an allocation a value that differs from it is an error."""
    follow: bool = True
    """With ``scheduler=slurm``: print the job's log until it ends and exit with its code (Ctrl-C stops following
    only); false: print the job id and log path and return at once."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The allocation ``scheduler=slurm`` asks for (``launch.slurm.*``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster and reservations of ``scheduler=ray`` (``launch.ray.*``, ``job/ray_launch_config.py``)."""

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"launch.scheduler={self.scheduler!r} is not one of {list(SCHEDULERS)}")
        _check_int("launch.nodes", self.nodes, low=1, optional=True)
        _check_bool("launch.follow", self.follow)
        self.slurm.validate()
        self.ray.validate()


def _check_int(key: str, value: Any, *, low: int, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} must be an integer >= {low}" + (" or null" if optional else ""))


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


SUBSECTIONS = {"slurm": SlurmConfig, "ray": RayConfig}


def launch_keys() -> set[str]:
    """Every dotted key of the section (``launch.nodes``, ``launch.slurm.time``, ...)."""
    return {f"launch.{f.name}" for f in dataclasses.fields(LaunchConfig) if f.name not in SUBSECTIONS} | {
        f"launch.{name}.{f.name}" for name, cls in SUBSECTIONS.items() for f in dataclasses.fields(cls)}


def launch_config_from_flat(flat: Mapping[str, Any]) -> LaunchConfig:
    """The section from the flat ``{dotted key: value}`` of ``config_files.read_overrides`` (other sections are
    ignored; an unknown ``launch.*`` key is a ConfigError listing the valid ones)."""
    known = launch_keys()
    for key in flat:
        if key.startswith("launch.") and key not in known:
            raise ConfigError(f"unknown config key {key!r}; valid keys of 'launch': {sorted(known)}")
    sub = {name: {k.removeprefix(f"launch.{name}."): v for k, v in flat.items() if k.startswith(f"launch.{name}.")}
           for name in SUBSECTIONS}
    top = {k.removeprefix("launch."): v for k, v in flat.items() if k in known and k.count(".") == 1}
    if sub["slurm"].get("extra", []) is None:
        sub["slurm"]["extra"] = []
    return LaunchConfig(**top, **{name: cls(**sub[name]) for name, cls in SUBSECTIONS.items()})
