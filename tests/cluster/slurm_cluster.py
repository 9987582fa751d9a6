"""A real two-node Slurm cluster on this one machine, for the tests (Debian's ``slurm-wlm``; no mocks).

``SlurmCluster().start()`` starts, from a private temporary folder with free ports,

    munged      its own socket in the folder (``AuthInfo=socket=...``), run as the ``munge`` user
    slurmctld   ``-D -f <folder>/slurm.conf``
    slurmd x 2  nodes ``n1`` and ``n2`` in slurmd's multiple-slurmd mode (``-N <node>``; Debian's build has it),
                each pinned with ``taskset`` to its own core (core 0 and core 1; one core: both on core 0), each
                with its own port, spool folder and log

and ``stop()`` cancels the jobs still there and ends exactly those processes (the Popen handles it holds).
The daemons log at level ``debug`` and a finished job's record goes to ``jobcomp.txt`` (``jobcomp/filetxt``; there
is no accounting database, so no ``sacct``): ``report(job_id)`` gathers them, with ``scontrol show job`` and
``sinfo``, for a failing test's message. ``MEGATRON_RL_KEEP_SLURM=1`` keeps the folder after ``stop()``.
Clients reach the cluster through ``env()`` (``SLURM_CONF``). ``scripts/setup_slurm.sh`` installs the packages;
``require_slurm()`` fails (CI, ``MEGATRON_RL_REQUIRE_SLURM=1``) or skips when they are missing.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

NODES = ("n1", "n2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")


def require_slurm() -> None:
    """Skip without Slurm (a developer machine), fail instead in CI (``scripts/test.sh`` sets the variable)."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    why = None
    if missing:
        why = f"Slurm is not installed ({', '.join(missing)} missing): run `bash scripts/setup_slurm.sh` (root, apt)"
    elif os.geteuid() != 0:
        why = "the Slurm test cluster runs its daemons as root (SlurmdUser=root): run the tests as root"
    if why is None:
        return
    if os.environ.get("MEGATRON_RL_REQUIRE_SLURM") == "1":
        pytest.fail(f"{why} (MEGATRON_RL_REQUIRE_SLURM=1: scripts/test.sh requires it)", pytrace=False)
    pytest.skip(why)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    """Two slurmd nodes and a slurmctld in ``folder`` (module docstring)."""

    def __init__(self) -> None:
        # under /tmp, not pytest's root-only folder: munged (the munge user) must reach its socket folder; a short
        # path also keeps the socket's name under the 108-byte limit
        self.folder = Path(tempfile.mkdtemp(prefix="megatron_rl_slurm_", dir="/tmp"))
        self.folder.chmod(0o755)
        self.conf = self.folder / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Slurm client of this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *command: str, timeout: float = 30) -> str:
        return subprocess.run(command, env=self.env(), capture_output=True, text=True, check=True,
                              timeout=timeout).stdout

    def start(self) -> SlurmCluster:
        try:
            self._start_all()
        except Exception as err:
            logs = self._log_tails()
            self.stop()  # what started so far, and the folder
            raise RuntimeError(f"the test Slurm cluster did not start: {err}\n{logs}") from err
        except BaseException:
            self.stop()
            raise
        return self

    def _log_tails(self) -> str:
        """The last lines of each daemon's output and log (the folder goes with ``stop``)."""
        tails = []
        for path in sorted([*self.folder.glob("*.out"), *self.folder.glob("*.log"), *self.folder.glob("munge/*.log")]):
            lines = path.read_text(errors="replace").splitlines()[-5:]
            tails.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    def _start_all(self) -> None:
        self._start_munge()
        self._write_conf()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        cores = os.sched_getaffinity(0)
        for i, node in enumerate(NODES):
            core = sorted(cores)[i % len(cores)]
            self._spawn(["taskset", "-c", str(core), "slurmd", "-D", "-f", str(self.conf), "-N", node],
                        f"slurmd-{node}")
        self._wait_idle()

    def _spawn(self, command: list[str], name: str, user: str | None = None) -> None:
        log = open(self.folder / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT, user=user,
                                           group=user))
        log.close()

    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(exist_ok=True)
        munge.chmod(0o755)  # munged wants its socket folder reachable by everyone
        shutil.chown(munge, "munge", "munge")
        self.munge_socket = munge / "munge.socket"
        self._spawn(["munged", "--foreground", f"--socket={self.munge_socket}",
                     f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                     f"--seed-file={munge / 'munged.seed'}"], "munged", user="munge")
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError("munged did not start")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ctld, *node_ports = free_ports(1 + len(NODES))
        f = self.folder
        lines = [
            "ClusterName=megatronrltest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            # cred_expire: Slurm holds a requeued job for cred_expire + 1 s (BeginTime) so that its new launch
            # credential is newer than the revocation of the old one, which slurmd records with the second of the
            # requeue: a relaunch within that second is refused ("Job <id> already killed, do not launch batch job")
            # and the job ends FAILED. The default hold is 121 s; 5 (Slurm's minimum) keeps it to 6 s in the tests,
            # and a scheduling pass each second (default: 60 s) starts the job when the hold ends
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SchedulerParameters=sched_interval=1",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool-%n'}", f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}", f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd-%n.log'}", f"SlurmctldPort={ctld}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none", "ReturnToService=2",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "KillWait=10", "MinJobAge=600",
            # for a failing test's message (report): the daemons' debug logs and the job records (no accounting
            # database, so no sacct)
            "SlurmctldDebug=debug", "SlurmdDebug=debug", "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={f / 'jobcomp.txt'}",
            # job ids (and so the default rendezvous ports, launch/slurm_env.py) differ between clusters running at
            # once on this machine: each would otherwise start at job 1, port 20001
            f"FirstJobId={random.randrange(1000, 19000)}",
            *[f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=4000"
              for node, port in zip(NODES, node_ports)],
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            try:
                states = self.run("sinfo", "-h", "-N", "-o", "%N %T")
            except subprocess.CalledProcessError:
                states = ""
            if sum(1 for line in states.splitlines() if line.split()[-1] == "idle") == len(NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes were not idle within {timeout} s (sinfo: {states!r})")

    def wait_job(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        """``scontrol show job`` fields once the job has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = dict(item.split("=", 1) for item in self.run("scontrol", "show", "job", "-o", job_id).split()
                          if "=" in item)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                return fields
            time.sleep(0.5)
        raise TimeoutError(f"Slurm job {job_id} still running after {timeout} s")

    def report(self, job_id: str | None = None, lines: int = 60) -> str:
        """What a failing test prints: ``scontrol show job`` (or ``squeue``), ``sinfo``, the job records and the
        daemons' logs (every line naming the job, then the last ``lines`` lines of each)."""
        parts = []
        for command in ((["scontrol", "show", "job", job_id] if job_id else ["squeue"]), ["sinfo", "-N", "-l"]):
            try:
                got = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=30)
                parts.append(f"--- {' '.join(command)}\n{got.stdout}{got.stderr}")
            except (OSError, subprocess.TimeoutExpired) as err:  # slurmctld gone: the logs below still tell
                parts.append(f"--- {' '.join(command)}: {err}")
        naming = re.compile(rf"\b{job_id}\b" if job_id else r"(?!)")
        for path in [self.folder / "jobcomp.txt", *sorted(self.folder.glob("*.log"))]:
            if path.exists():
                text = path.read_text(errors="replace").splitlines()
                named = [line for line in text[:-lines] if naming.search(line)]
                parts.append("\n".join([f"--- {path.name}", *named[-lines:], "...", *text[-lines:]]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job of this cluster, then end the daemons this object started (only those)."""
        if len(self.procs) > 1 and self.procs[1].poll() is None:  # slurmctld
            subprocess.run(["scancel", "--full", "--partition=test"], env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                jobs = subprocess.run(["squeue", "-h"], env=self.env(), capture_output=True, text=True, timeout=30)
                if jobs.returncode != 0 or not jobs.stdout.strip():
                    break
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if os.environ.get("MEGATRON_RL_KEEP_SLURM") != "1":
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A two-node test cluster per test module (import this fixture by name: ``from ... import cluster``)."""
    require_slurm()
    cluster = SlurmCluster().start()
    yield cluster
    cluster.stop()
