"""The batch script ``launch.scheduler=slurm`` writes and submits: readable, and re-submittable by hand.

Place in the data flow: ``launch/submit.py`` renders it (``render``) into ``<logging.output_dir>/slurm_job.sh``
(atomically) and runs ``sbatch --parsable`` on it. The script runs the user's own command again inside the
allocation (``bash run_megatron.sh <the same overrides>``, from the same directory), which then starts one
launcher per node with srun (``launch/plan.py``). Around it, the script

- forwards SIGUSR1 (``--signal=B:USR1@<launch.slurm.signal_s>``: the time limit is near) and SIGTERM (preemption,
  scancel) to that command, whose srun passes them to every node's launcher;
- on exit code 3 (``PREEMPTED_EXIT``: stopped on such a signal after saving a checkpoint) requeues the job when
  ``launch.slurm.requeue`` is true (the requeued job resumes from the checkpoint), else prints the command that
  continues the run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.job.launch_config import SlurmConfig

PREEMPTED_EXIT = 3
"""Exit code of a run that stopped on a preemption or time-limit signal after saving a checkpoint."""
SCRIPT_NAME = "slurm_job.sh"
LOG_NAME = "slurm-%j.log"
"""The job's log in the output folder (``%j``: the job id)."""
CARRIED_ENV = ("NPROC", "CONFIG", "PY", "MASTER_PORT", "OMP_NUM_THREADS", "MEGATRON_RL_ENGINE_PYTHON")
"""The caller's launch variables the script sets again (so that ``sbatch <script>`` by hand runs the same job)."""


@dataclass(frozen=True)
class BatchJob:
    """Everything the script says."""

    nodes: int
    slurm: SlurmConfig
    output_dir: Path
    workdir: Path
    """The caller's directory (relative paths in the overrides are taken from it)."""
    launcher: Path
    """``run_megatron.sh`` of this checkout."""
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    """``CARRIED_ENV`` values the caller had."""
    job_name: str = "megatron_rl"


def render(job: BatchJob) -> str:
    """The script's text (a pure function of ``job``)."""
    script = job.output_dir / SCRIPT_NAME
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
               f"--output={job.output_dir / LOG_NAME}", "--open-mode=append", *job.slurm.sbatch_options()]
    exports = [f"export {name}={shlex.quote(value)}" for name, value in job.env]
    command = shlex.join(["bash", str(job.launcher), *job.args])
    requeue = "true" if job.slurm.requeue else "false"
    return "\n".join([
        "#!/bin/bash",
        "# The megatron_rl run that `bash run_megatron.sh launch.scheduler=slurm ...` submitted (megatron_rl/launch).",
        f"# Submit it again by hand with: sbatch {shlex.quote(str(script))}",
        *[f"#SBATCH {option}" for option in options],
        "set -u",
        f"cd {shlex.quote(str(job.workdir))}",
        *exports,
        "# the command a preemption stop's line names to continue the run (the launchers read MEGATRON_RL_COMMAND)",
        f"export MEGATRON_RL_COMMAND={shlex.quote(f'sbatch {shlex.quote(str(script))}')}",
        'echo "slurm_job.sh: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"',
        "# The run in the background, so that this shell can pass Slurm's signals on (srun forwards them to the",
        "# launcher of every node): USR1 = the time limit is near, TERM = preemption or scancel.",
        f"{command} &",
        "pid=$!",
        "trap 'echo \"slurm_job.sh: SIGUSR1 (time limit near): passing it to the run\"; kill -USR1 $pid' USR1",
        "trap 'echo \"slurm_job.sh: SIGTERM: passing it to the run\"; kill -TERM $pid' TERM",
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done  # a trapped signal ends `wait` early',
        'wait "$pid"; code=$?',
        f"if [ \"$code\" = {PREEMPTED_EXIT} ]; then",
        f"  if {requeue}; then",
        '    echo "slurm_job.sh: the run stopped on a signal after saving a checkpoint; requeueing job $SLURM_JOB_ID' 
        ' (it resumes from that checkpoint)"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  fi",
        '  echo "slurm_job.sh: the run stopped on a preemption or time-limit signal after saving a checkpoint;'
        f' continue it with: sbatch {shlex.quote(str(script))}"',
        "fi",
        'exit "$code"',
        "",
    ])
