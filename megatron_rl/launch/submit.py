"""``launch.scheduler=slurm``: write the batch script, submit it, follow its log until the job ends.

Place in the data flow: ``run_megatron.sh`` execs ``python -m megatron_rl.launch.submit --config <file> ...
<overrides>`` when ``launch/plan.py`` says so (outside an allocation). It writes
``<logging.output_dir>/slurm_job.sh`` (``launch/batch_script.py``; atomically), runs ``sbatch --parsable``, prints
the job id and the log path, then (``launch.follow``) prints the log as it grows until the job ends and exits with
the job's exit code. Ctrl-C stops following only: the job keeps running, and one line says how to cancel it and how
to follow it again.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from megatron_rl.atomic import atomic_write_text
from megatron_rl.config_files import ConfigError, read_overrides
from megatron_rl.job.launch_config import LaunchConfig, launch_config_from_flat
from megatron_rl.job.paths import absolute, caller_cwd
from megatron_rl.launch import batch_script, slurm_cli
from megatron_rl.launch.plan import LAUNCHER, split_args

POLL_S = 1.0


def output_dir(flat: Mapping[str, object]) -> Path:
    """``logging.output_dir`` as the run will see it (relative: from the caller's directory)."""
    value = flat.get("logging.output_dir")
    if not isinstance(value, str) or not value:
        from megatron_rl.config import LoggingConfig  # the default (imports torch: only when the key is unset)

        value = LoggingConfig.output_dir
    return Path(absolute(value, caller_cwd()))


def batch_job(argv: Sequence[str], launch: LaunchConfig, out: Path, env: Mapping[str, str]) -> batch_script.BatchJob:
    _, overrides = split_args(argv)
    nodes = launch.nodes or int(env.get("NNODES") or 1)
    carried = [(name, env[name]) for name in batch_script.CARRIED_ENV if env.get(name)]  # the script cds to workdir
    return batch_script.BatchJob(nodes=nodes, slurm=launch.slurm, output_dir=out, workdir=caller_cwd(),
                                 launcher=LAUNCHER, args=tuple(overrides), env=tuple(carried))


def follow(job_id: str, log: Path, script: Path | None = None) -> int:
    """Print ``log`` as it grows until the job ends; the job's exit code (130 on Ctrl-C: the job keeps running).
    A job Slurm stopped (time limit, preemption without requeue) gets the command that continues it (``script``)."""
    offset = 0
    try:
        while True:
            state = slurm_cli.job_state(job_id)
            offset = _print_new(log, offset)
            if state is None or state.state in slurm_cli.ENDED_STATES:
                time.sleep(POLL_S)  # the last lines may reach the shared file system a moment after the state
                _print_new(log, offset)
                code = state.exit_code if state else 0
                print(f"run_megatron.sh: Slurm job {job_id} ended: {state.state if state else 'gone'}, exit code "
                      f"{code}", flush=True)
                if state and state.state in ("TIMEOUT", "PREEMPTED") and script is not None:
                    print(f"run_megatron.sh: the job was stopped by Slurm ({state.state}); continue it from its last "
                          f"checkpoint with: sbatch {script}", flush=True)
                return code
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print(f"\nrun_megatron.sh: stopped following; Slurm job {job_id} keeps running. Cancel it with: scancel "
              f"{job_id}; follow it again with: tail -f {log}", flush=True)
        return 130


def _print_new(log: Path, offset: int) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(data)


def main(argv: Sequence[str]) -> int:
    configs, overrides = split_args(argv)
    try:
        flat = read_overrides(configs, overrides)
        launch = launch_config_from_flat(flat)
        out = output_dir(flat)
        out.mkdir(parents=True, exist_ok=True)
        script = out / batch_script.SCRIPT_NAME
        atomic_write_text(script, batch_script.render(batch_job(argv, launch, out, os.environ)))
        job_id = slurm_cli.sbatch(str(script))
    except (ConfigError, OSError, slurm_cli.SlurmError) as err:
        print(f"run_megatron.sh: {err}", file=sys.stderr)
        return 2
    log = out / batch_script.LOG_NAME.replace("%j", job_id)
    print(f"run_megatron.sh: submitted Slurm job {job_id} ({launch.nodes or 'derived'} node(s)); batch script "
          f"{script} (sbatch it again by hand to re-run); log {log}", flush=True)
    if not launch.follow:
        print(f"run_megatron.sh: follow it with: tail -f {log}; cancel it with: scancel {job_id}")
        return 0
    return follow(job_id, log, script)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
