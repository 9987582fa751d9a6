"""The Slurm commands the launch runs (``sbatch``, ``scontrol``), each behind one function.

Place in the data flow: ``launch/plan.py`` asks for the first node's address inside an allocation;
``launch/submit.py`` submits and watches a job. Errors are ``SlurmError`` with the command and Slurm's own words.
``$SLURM_CONF`` and the PATH choose the cluster, as for any Slurm client.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE"})
"""Job states after which nothing more runs (a requeued job goes back to PENDING instead)."""


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing."""


def run(command: list[str], timeout: float = 60) -> str:
    """``command``'s stdout; SlurmError naming it when it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} not found: launch.scheduler=slurm needs the Slurm client commands on PATH "
                         "(run on a login node of your cluster)")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SlurmError(f"{' '.join(command)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames <nodelist>``: ``node[1-2]`` -> ``['node1', 'node2']``."""
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def node_address(name: str) -> str:
    """The address Slurm reaches node ``name`` at (its ``NodeAddr``; the host name on most clusters)."""
    match = re.search(r"\bNodeAddr=(\S+)", run(["scontrol", "show", "node", "-o", name]))
    return match.group(1) if match else name


def sbatch(script: str) -> str:
    """Submit ``script``; its job id (``sbatch --parsable``: ``id`` or ``id;cluster``)."""
    return run(["sbatch", "--parsable", script]).strip().split(";")[0]


@dataclass(frozen=True)
class JobState:
    state: str
    """Slurm's job state (PENDING, RUNNING, COMPLETED, ...)."""
    exit_code: int
    """The batch script's exit code (``ExitCode=<code>:<signal>``; 128 + signal when killed by one)."""


def job_state(job_id: str) -> JobState | None:
    """``scontrol show job``'s state and exit code, or None once Slurm has forgotten the job (MinJobAge)."""
    try:
        text = run(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return None
        raise
    state = re.search(r"\bJobState=(\S+)", text)
    code = re.search(r"\bExitCode=(\d+):(\d+)", text)
    exit_code = 0
    if code:
        exit_code = int(code.group(1)) or (128 + int(code.group(2)) if int(code.group(2)) else 0)
    return JobState(state.group(1) if state else "UNKNOWN", exit_code)
