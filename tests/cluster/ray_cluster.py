"""A real two-node Ray cluster on this one machine, for the tests (the ``ray`` package of the venv; no mocks).

``RayCluster().start()`` starts, from a private temporary folder (``RAY_TMPDIR``) with a free GCS port,

    head     ray start --head --block, node_a: 1 (a custom resource naming the node), its own CPUs
    worker   ray start --address=<head> --block, node_b: 1, its own CPUs (once the head is up)

(no usage stats; no dashboard unless ``RayCluster(dashboard=True)``: then the head also serves Ray's dashboard and
its job API, for ``ray job submit``, at ``dashboard_url``, and its metrics on a free port, not Ray's fixed 44227; each
node's dashboard agent listens on a free port of its own, not Ray's fixed 52365, so that two nodes and other clusters
on this machine do not collide), each in its own
session, and ``stop()`` ends exactly those two process trees (the
Popen handles it holds: SIGTERM to ``ray start --block``, which stops its node; then SIGKILL of what is left of
each session). Clients reach the cluster through ``env()`` (``RAY_ADDRESS``, ``RAY_TMPDIR``). The ``ray`` extra
(setup.py) is installed by ``scripts/setup.sh``; ``require_ray()`` fails when it is missing: Ray is a dependency of
the test suite, never skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

NODES = ("node_a", "node_b")
RAY = str(Path(sys.executable).parent / "ray")
STARTED = "Ray runtime started"
"""What ``ray start`` prints once its node is up (and, for a worker, joined the head)."""


def require_ray() -> None:
    """Fail (not skip) without the ``ray`` package: scripts/setup.sh installs it with the ``ray`` extra."""
    if not Path(RAY).exists():
        pytest.fail(f"ray is not installed in {sys.prefix}: run `bash scripts/setup.sh` (it installs the 'ray' extra "
                    "of setup.py)", pytrace=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ppid(pid: str) -> int:
    return int((Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()[1])


class RayCluster:
    """Two Ray nodes on this machine (module docstring)."""

    def __init__(self, cpus_per_node: int = 1, dashboard: bool = False) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="mrl_ray_", dir="/tmp"))  # short: Ray's socket paths
        self.port = free_port()
        self.dashboard_port = free_port() if dashboard else None
        self.metric_port = free_port() if dashboard else None  # not the dashboard's fixed 44227 (another cluster's)
        self.cpus = cpus_per_node
        self.procs: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """The job API's address (``ray job submit --address``)."""
        assert self.dashboard_port is not None, "RayCluster(dashboard=True) serves the job API"
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client of this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        metrics = {"DASHBOARD_METRIC_PORT": str(self.metric_port)} if self.metric_port else {}
        return {**env, "RAY_TMPDIR": str(self.folder), "RAY_ADDRESS": self.address,
                "RAY_USAGE_STATS_ENABLED": "0", **metrics, **extra}

    def start(self, timeout: float = 240) -> RayCluster:
        common = ["--block", f"--num-cpus={self.cpus}", "--num-gpus=0", "--disable-usage-stats"]
        dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                      f"--dashboard-port={self.dashboard_port}"] if self.dashboard_port else ["--include-dashboard=false"])
        deadline = time.monotonic() + timeout
        self._start_node("head", lambda: [RAY, "start", "--head", f"--port={self.port}", *dashboard, *self._agent(),
                                          f"--resources={json.dumps({NODES[0]: 1})}", *common], deadline)
        self._start_node("worker", lambda: [RAY, "start", f"--address={self.address}", *self._agent(),
                                            f"--resources={json.dumps({NODES[1]: 1})}", *common], deadline)
        if self.dashboard_port:
            self._wait_job_api(timeout)
        return self

    @staticmethod
    def _agent() -> list[str]:
        return [f"--dashboard-agent-listen-port={free_port()}"]

    def _wait_job_api(self, timeout: float) -> None:
        """Until the head's job API answers (``ray job list``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = subprocess.run([RAY, "job", "list", "--address", self.dashboard_url], env=self.env(),
                                    capture_output=True, text=True)
            if listed.returncode == 0:
                return
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the test Ray cluster's job API did not answer in {timeout} s: {listed.stderr[-2000:]}")

    def _spawn(self, command: list[str], name: str) -> None:
        log = open(self.folder / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, cwd=self.folder))
        log.close()

    def _start_node(self, name: str, command, deadline: float, attempts: int = 3) -> None:
        """``ray start`` of one node until it says "Ray runtime started" (the worker's once it joined the head); the
        worker starts once the head did (started together, the worker's start gave up on a head not in the GCS
        yet). Ray gives a node's raylet a fixed 30 s to register with the GCS (``ray/_private/node.py``); at load
        averages of ~30-50 ``ray start`` ran out of it and exited: then that node starts again (its session ended
        first), up to ``attempts`` times."""
        log = self.folder / f"{name}.out"
        for attempt in range(attempts):
            if attempt and name == "head":
                self.port = free_port()  # the failed head's port may linger
            self._spawn(command(), name)
            proc = self.procs[-1]
            while time.monotonic() < deadline and proc.poll() is None:
                if STARTED in log.read_text(errors="replace"):
                    return
                time.sleep(0.5)
            if proc.poll() is None:
                break  # the deadline
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what its session started (a raylet, the GCS)
            except ProcessLookupError:
                pass
            proc.wait()
            self.procs.remove(proc)
        text = {p.name: p.read_text(errors="replace")[-2000:] for p in sorted(self.folder.glob("*.out"))}
        self.stop()
        raise RuntimeError(f"the test Ray cluster's {name} did not come up ({attempts} tries at most): {text}")

    def actors(self, marker: str) -> list[str]:
        """``pid ppid cmdline`` of the live processes with ``marker`` (e.g. ``RankProcess``) that run under this
        cluster's raylets: an ancestor's command line names its folder. Another test's cluster on the machine (the
        other test worker's) is not this one's."""
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if marker not in line:
                    continue
                ppid, pid, chain = _ppid(proc.name), proc.name, []
                for _ in range(12):  # up the tree to this cluster's raylet, or to init
                    parent = (Path("/proc") / str(ppid) / "cmdline").read_bytes().decode(errors="replace")
                    chain.append(parent)
                    if str(self.folder) in parent or ppid <= 1:
                        break
                    ppid = _ppid(str(ppid))
            except (OSError, ValueError):
                continue
            if any(str(self.folder) in parent for parent in chain):
                found.append(f"{pid} {_ppid(pid)} {line}")
        return found

    def stop(self) -> None:
        """End the two nodes this object started (only those) and remove the folder."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever its session still holds (raylet, gcs, workers)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs = []
        shutil.rmtree(self.folder, ignore_errors=True)
