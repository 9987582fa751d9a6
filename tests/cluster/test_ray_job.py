"""``ray job submit -- bash run_megatron.sh launch.scheduler=ray ...`` and ``ray job stop`` on a real two-node Ray
cluster whose head serves the job API (``RayCluster(dashboard=True)``: the ``ray[default]`` extra).

(a) the CPU demo submitted as a Ray job (DP2, one rank per Ray node) succeeds with the same per-step metrics as the
    plain local run (``NPROC=2``, run at the same time); the job's log has rank 0's progress;
(b) a long submission, stopped with ``ray job stop`` once it saved its first checkpoint, ends STOPPED; the driver
    passed the stop on as Ctrl-C (the job's interrupted line: ``RAY_JOB_STOP_WAIT_TIME_S`` gives it the time, Ray's
    default 3 s SIGKILLs the driver first on this loaded machine; then Ray ends its actors and each rank dies with
    its actor: no process left either, measured once by hand); afterwards
    no process of the job (entrypoint, driver, rank) and no rank actor is left on either simulated node (``ps``:
    they share this machine's), no actor is alive (``ray list actors``, the state API); the checkpoint is intact:
    the next submission of the same command resumes after it and runs to its end.

The entrypoint runs where ``ray start --head`` runs (this machine; ``RAY_ADDRESS`` set by the job runtime), in the
checkout (``cd``: the repo is on every node at the same path, so no ``--working-dir``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.cluster.ray_cluster import RAY, RayCluster, require_ray
from tests.cluster.test_ray_launch import DEMO, RAY_RUN, launch, processes
from tests.support.job_run import untimed_metrics as metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
STOP_WAIT_S = 60
"""``RAY_JOB_STOP_WAIT_TIME_S`` of the stopped job: time for the driver's Ctrl-C path (docs/RAY.md)."""


@pytest.fixture(scope="module")
def cluster():
    require_ray()
    t0 = time.monotonic()
    cluster = RayCluster(cpus_per_node=2, dashboard=True).start()  # 2 CPUs a node: the local run beside the job
    print(f"\nRay cluster with its job API up in {time.monotonic() - t0:.1f} s")
    yield cluster
    cluster.stop()


def entrypoint(out_dir: Path, *args: str) -> str:
    """The job's shell line: the README's Ray line run from the checkout."""
    line = ["bash", "run_megatron.sh", *DEMO, *RAY_RUN, *args, f"logging.output_dir={out_dir}"]
    return (f"cd {shlex.quote(str(ROOT))} && PY={shlex.quote(sys.executable)} NPROC=1 OMP_NUM_THREADS=1 "
            + shlex.join(line))


def ray_job(cluster: RayCluster, command: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "job", command, "--address", cluster.dashboard_url, *args], env=cluster.env(),
                          capture_output=True, text=True, timeout=timeout)


def submit(cluster: RayCluster, job_id: str, out_dir: Path, *args: str, wait: bool = True,
           stop_wait_s: int | None = None) -> subprocess.CompletedProcess:
    """``ray job submit -- bash -c '<entrypoint>'`` (ray joins the words after ``--`` shell-quoted); with
    ``stop_wait_s``, ``ray job stop`` waits that long after its SIGTERM before its SIGKILL (Ray's default: 3 s)."""
    env = ["--runtime-env-json", json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait_s)}})] \
        if stop_wait_s else []
    return ray_job(cluster, "submit", f"--submission-id={job_id}", *env, *([] if wait else ["--no-wait"]), "--",
                   "bash", "-c", entrypoint(out_dir, *args), timeout=400)


def status(cluster: RayCluster, job_id: str) -> str:
    """The job's status (``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``STOPPED``, ...), from the job API."""
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(cluster.dashboard_url).get_job_status(job_id).value)


def alive_actors(cluster: RayCluster) -> list[dict]:
    listed = subprocess.run([RAY, "list", "actors", "--filter", "state=ALIVE", "--format", "json", "--address",
                             cluster.address], env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return [] if listed.stdout.startswith("No resource") else json.loads(listed.stdout)


def test_ray_job_submit_equals_the_local_run(cluster: RayCluster, tmp_path: Path) -> None:
    """(a) the job succeeds; its metrics are the local run's."""
    t0 = time.monotonic()
    local, on_ray = tmp_path / "local", tmp_path / "job"
    local_run = launch(cluster, local, f"demo.num_steps={STEPS}", nproc=2)  # beside the job: the cores stay busy
    job = submit(cluster, "mrl-equal", on_ray, f"demo.num_steps={STEPS}")
    out, err = local_run.communicate(timeout=400)
    assert local_run.returncode == 0, out + err
    assert job.returncode == 0 and "Job 'mrl-equal' succeeded" in job.stdout, job.stdout[-4000:] + job.stderr
    assert status(cluster, "mrl-equal") == "SUCCEEDED"
    assert len(metrics(on_ray)) == STEPS
    assert metrics(on_ray) == metrics(local)
    assert "on the Ray cluster" in job.stdout and f"step {STEPS}/{STEPS}" in job.stdout  # the driver's, rank 0's
    print(f"\nlocal NPROC=2 run and the Ray job together: {time.monotonic() - t0:.1f} s")


def test_ray_job_stop_leaves_nothing_and_the_checkpoint_resumes(cluster: RayCluster, tmp_path: Path) -> None:
    """(b) ``ray job stop``: STOPPED, no process or actor left, the next submission resumes."""
    t0 = time.monotonic()
    out_dir = tmp_path / "stopped"
    long_run = ["demo.num_steps=1000", "checkpoint.save_interval=1"]
    job = submit(cluster, "mrl-stop", out_dir, *long_run, wait=False, stop_wait_s=STOP_WAIT_S)
    assert job.returncode == 0, job.stdout + job.stderr
    deadline = time.monotonic() + 300
    rows = lambda: len(metrics(out_dir)) if (out_dir / "metrics.jsonl").exists() else 0  # noqa: E731
    while rows() < 2:  # the checkpoint of step 1 is complete: the ranks train on both nodes
        assert time.monotonic() < deadline and status(cluster, "mrl-stop") in ("PENDING", "RUNNING"), \
            ray_job(cluster, "logs", "mrl-stop").stdout[-4000:]
        time.sleep(1)
    stopped = ray_job(cluster, "stop", "mrl-stop", timeout=120)  # waits for the job to end
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert status(cluster, "mrl-stop") == "STOPPED"
    deadline = time.monotonic() + 30
    left = lambda: processes(str(out_dir)) + cluster.actors("RankProcess")  # noqa: E731
    while (left() or alive_actors(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []
    assert alive_actors(cluster) == []
    done = rows()
    log = ray_job(cluster, "logs", "mrl-stop").stdout
    assert "megatron_rl: interrupted during step" in log, log[-3000:]  # the ranks stopped, the driver said so
    print(f"\nstopped after step {done}: {time.monotonic() - t0:.1f} s", flush=True)
    resumed = submit(cluster, "mrl-resume", out_dir, f"demo.num_steps={done + 1}", "checkpoint.save_interval=1")
    assert resumed.returncode == 0 and "Job 'mrl-resume' succeeded" in resumed.stdout, \
        resumed.stdout[-4000:] + resumed.stderr
    saved = re.search(r"resuming after step (\d+)", resumed.stdout)
    assert saved and done - 1 <= int(saved.group(1)) <= done, resumed.stdout[-4000:]  # the last complete save
    assert metrics(out_dir)[-1]["step"] == done + 1
    print(f"\nsubmitted, stopped, resumed: {time.monotonic() - t0:.1f} s")
