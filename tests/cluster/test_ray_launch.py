"""``run_megatron.sh launch.scheduler=ray`` on a real two-node Ray cluster (``ray_cluster.py``: ``ray start --head``
and a second ``ray start --address``, each with its own CPUs and a custom resource naming it).

(a) the CPU demo (DP2, one rank per Ray node: ``NPROC=1 launch.nodes=2``) has the same per-step metrics as the
    plain local run (``NPROC=2``; bitwise equal to the by-hand two-node run too, measured); the two ranks ran on two
    Ray nodes; each rank's full log is in the output folder; the driver printed rank 0's progress;
(b) two runs at once: Ctrl-C of one driver (SIGINT to its process group, as a terminal sends it) ends it with the
    job's interrupted line and exit 130; a SIGKILL of the other's rank-1 actor process ends that run with one line
    naming the rank and its node, exit 1; afterwards no rank, no rank actor of either run is left (``ps``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.cluster.ray_cluster import RayCluster, require_ray
from tests.support.job_run import untimed_metrics as metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
DEMO = ["demo.baseline_episodes=20", "logging.progress_bar=false", "logging.tensorboard=false",
        "parallel.device=cpu", "checkpoint.save_interval=0", "optimizer.lr=2e-3"]
RAY_RUN = ["launch.scheduler=ray", "launch.nodes=2", "launch.ray.placement_timeout_s=60"]


@pytest.fixture(scope="module")
def cluster():
    require_ray()
    t0 = time.monotonic()
    cluster = RayCluster(cpus_per_node=2).start()  # 2 logical CPUs a node: (b) runs two jobs at once
    print(f"\nRay cluster up in {time.monotonic() - t0:.1f} s")
    yield cluster
    cluster.stop()


def launch(cluster: RayCluster, out_dir: Path, *args: str, nproc: int = 1) -> subprocess.Popen:
    env = cluster.env(PY=sys.executable, NPROC=str(nproc), OMP_NUM_THREADS="1")
    return subprocess.Popen(["bash", "run_megatron.sh", *DEMO, *args, f"logging.output_dir={out_dir}"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def processes(marker: str) -> list[str]:
    """This machine's processes whose command line has ``marker`` (every simulated node shares its ``ps``)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -ww" not in line]


def rank_pid(out_dir: Path, rank: int) -> int:
    """The pid of the run's rank ``rank`` (its environment says ``RANK``)."""
    for line in processes(f"logging.output_dir={out_dir}"):
        pid = int(line.split()[0])
        if "megatron_rl.job.main" not in line:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} of {out_dir} running: {processes(str(out_dir))}")


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ray_run_equals_the_local_run(cluster: RayCluster, tmp_path: Path) -> None:
    """(a) The README's Ray line: same metrics as ``NPROC=2 bash run_megatron.sh``, one rank per Ray node."""
    t0 = time.monotonic()
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    runs = [launch(cluster, local, f"demo.num_steps={STEPS}", nproc=2),  # both at once: the cores stay busy
            launch(cluster, on_ray, *RAY_RUN, f"demo.num_steps={STEPS}")]
    (out, err), (ray_out, ray_err) = [proc.communicate(timeout=400) for proc in runs]
    assert runs[0].returncode == 0, out + err
    assert runs[1].returncode == 0, ray_out + ray_err
    assert metrics(on_ray) == metrics(local)
    assert len(metrics(on_ray)) == STEPS
    assert "run_megatron.sh: 1 process(es) per node x 2 node(s) on the Ray cluster" in ray_out
    placed = re.search(r"ranks 0-0 on node 0 \(Ray node \S+ (\w+),.*ranks 1-1 on node 1 \(Ray node \S+ (\w+),", ray_out)
    assert placed and placed.group(1) != placed.group(2), ray_out  # STRICT_SPREAD: two Ray nodes
    assert f"step {STEPS}/{STEPS}" in ray_out and "Outputs: " in ray_out  # rank 0's lines, through the driver
    logs = sorted(p.name for p in (on_ray / "ray_logs").iterdir())
    assert logs == ["rank_0.log", "rank_1.log"]
    assert f"step {STEPS}/{STEPS}" in (on_ray / "ray_logs" / "rank_0.log").read_text()
    assert cluster.actors("RankProcess") == []  # every actor ended with its driver
    print(f"\nlocal NPROC=2 and Ray runs together: {time.monotonic() - t0:.1f} s")


def test_ctrl_c_and_a_killed_rank_actor(cluster: RayCluster, tmp_path: Path) -> None:
    """(b) Ctrl-C: the interrupted line, 130; a killed rank actor: one line naming the rank and node, 1; nothing
    of either run is left."""
    t0 = time.monotonic()
    stopped, killed = tmp_path / "ctrl_c", tmp_path / "killed"
    runs = {out_dir: launch(cluster, out_dir, *RAY_RUN, "demo.num_steps=1000") for out_dir in (stopped, killed)}
    deadline = time.monotonic() + 300
    while not all((out_dir / "metrics.jsonl").exists() for out_dir in runs):  # both train, on both nodes
        assert time.monotonic() < deadline and all(p.poll() is None for p in runs.values()), \
            {str(d): p.poll() for d, p in runs.items()}
        time.sleep(1)
    os.killpg(runs[stopped].pid, signal.SIGINT)  # the terminal's Ctrl-C: the driver's process group
    actor = parent(rank_pid(killed, 1))
    assert "ray::RankProcess" in Path(f"/proc/{actor}/cmdline").read_text()  # the rank's actor (its process title)
    assert str(actor) in [line.split()[0] for line in cluster.actors("RankProcess")]  # what the leftover check sees
    os.kill(actor, signal.SIGKILL)
    out, err = runs[stopped].communicate(timeout=180)
    assert runs[stopped].returncode == 130, out + err
    assert "megatron_rl: interrupted during step" in err, out + err
    out, err = runs[killed].communicate(timeout=180)
    assert runs[killed].returncode == 1, out + err
    died = [line for line in err.splitlines() if "died" in line]
    assert len(died) == 1 and died[0].startswith(
        "run_megatron.sh: trainer rank 1 (Ray actor megatron_rl-rank1) on node 1 (Ray node "), err
    deadline = time.monotonic() + 30
    left = lambda: processes(str(stopped)) + processes(str(killed)) + cluster.actors("RankProcess")  # noqa: E731
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []
    print(f"\ntwo runs, Ctrl-C and a killed actor: {time.monotonic() - t0:.1f} s")
