"""``run_megatron.sh launch.scheduler=ray`` on one real two-node Ray cluster (``ray_cluster.py``: ``ray start --head``
and a second ``ray start --address``, each with its own CPUs and a custom resource naming it; the head serves the
dashboard's job API, ``RayCluster(dashboard=True)``, for ``ray job submit``). The module's tests share the cluster
(one start, ~13-50 s, instead of one per test file) and run one after the other on it, so each one's leftover check
sees only its own run's processes and actors.

(a) the CPU demo (DP2, one rank per Ray node: ``NPROC=1 launch.nodes=2``), launched from a terminal and submitted
    as a Ray job (``ray job submit -- bash -c 'cd <checkout> && ... bash run_megatron.sh ...'``), has the same
    per-step metrics as the plain local run (``NPROC=2``; bitwise equal to the by-hand two-node run too, measured),
    all three at once; the launched run's two ranks ran on two Ray nodes, each rank's full log is in the output
    folder, the driver printed rank 0's progress; the job ended ``SUCCEEDED`` with rank 0's progress in its log;
(b) two runs at once: Ctrl-C of one driver (SIGINT to its process group, as a terminal sends it) ends it with the
    job's interrupted line and exit 130; a SIGKILL of the other's rank-1 actor process ends that run with one line
    naming the rank and its node, exit 1; afterwards no rank, no rank actor of either run is left (``ps``);
(c) a long submission, stopped with ``ray job stop`` once it saved its first checkpoint, ends STOPPED; the driver
    passed the stop on as Ctrl-C (the job's interrupted line: ``RAY_JOB_STOP_WAIT_TIME_S`` gives it the time, Ray's
    default 3 s SIGKILLs the driver first on this loaded machine; then Ray ends its actors and each rank dies with
    its actor: no process left either, measured once by hand); afterwards no process of the job (entrypoint, driver,
    rank) and no rank actor is left on either simulated node (``ps``: they share this machine's), no actor is alive
    (``ray list actors``, the state API); the checkpoint is intact: the next submission of the same command resumes
    after it and runs to its end;
(d) ``rollout.engine_nodes=1``: one run of the vLLM demo (``configs/demo_vllm.yaml``, ``NPROC=1 launch.nodes=2``, ten
    steps) checks that the engine host (an actor ``megatron_rl-engine_node1``, ``launch/ray_engines.py``) and every
    vLLM engine it starts run on the second Ray node (``node_b``: ``launch.ray.engine_node_resource=node_b``, the
    custom resource naming it) and the trainer's rank on the first (``node_a``, the other: STRICT_SPREAD): the node
    of a process is that of the raylet above it (its ``--static_resource_list`` names the node's custom resource),
    read from ``/proc`` while the run goes on; the engine's log-probs agree with the trainer's within 1e-4 at every
    step (the bound of ``tests/job/test_engine_nodes_job.py``); the engine host's actor process, SIGKILLed once the
    first step is done (its host and engine die with it), is replaced: the driver says so, starts a new actor in the
    same bundle (on ``node_b`` again), rank 0's fleet adopts its engine (``rollout/engine_restarts``) and the run
    finishes (exit 0, every step); afterwards no rank, engine host, engine, or actor of either kind is left (``ps``).
    Its engine is started by the engine host itself, not forked from the test session's zygote
    (``tests/support/engine_zygote.py``: a zygote's engine would run outside the Ray node).

The job's entrypoint runs where ``ray start --head`` runs (this machine; ``RAY_ADDRESS`` set by the job runtime), in
the checkout (``cd``: the repo is on every node at the same path, so no ``--working-dir``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.cluster.ray_cluster import NODES, RAY, RayCluster, require_ray
from tests.support.engine_env import engine_python
from tests.support.job_run import untimed_metrics as metrics

from megatron_rl.inference.engine_process.zygote import ZYGOTE_ENV

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
DEMO = ["demo.baseline_episodes=20", "logging.progress_bar=false", "logging.tensorboard=false",
        "parallel.device=cpu", "checkpoint.save_interval=0", "optimizer.lr=2e-3"]
RAY_RUN = ["launch.scheduler=ray", "launch.nodes=2", "launch.ray.placement_timeout_s=60"]
STOP_WAIT_S = 60
"""``RAY_JOB_STOP_WAIT_TIME_S`` of the stopped job: time for the driver's Ctrl-C path (docs/RAY.md)."""
ENGINE_STEPS = 10
"""(d): enough for the fleet to see its engine gone and adopt the replacement before the run ends: the killed host's
engine may serve a few more steps until its watchdog ends it (a CI rehearsal at load ~7: it died at the weight sync
after step 3, and a 4-step run ended with no restart adopted)."""
TOLERANCE = 1e-4  # as in tests/job/test_engine_nodes_job.py
ACTORS = ("ray::EngineHostProcess", "ray::RankProcess")
"""The process titles of (d)'s actors (the module's other tests, before it on the same cluster, left none)."""


@pytest.fixture(scope="module")
def cluster():
    require_ray()
    t0 = time.monotonic()
    # 2 logical CPUs a node: (a) and (b) run two Ray jobs at once; (d) has room for a wrong (packed) placement to show
    cluster = RayCluster(cpus_per_node=2, dashboard=True).start()
    print(f"\nRay cluster with its job API up in {time.monotonic() - t0:.1f} s")
    yield cluster
    cluster.stop()


def launch(cluster: RayCluster, out_dir: Path, *args: str, nproc: int = 1) -> subprocess.Popen:
    """``bash run_megatron.sh`` as from a terminal: SIGINT at its default even when pytest itself runs with it ignored
    (a background job of a script, ``pytest ... &``: (b)'s Ctrl-C would otherwise reach a driver that ignores it)."""
    env = cluster.env(PY=sys.executable, NPROC=str(nproc), OMP_NUM_THREADS="1")
    return subprocess.Popen(["bash", "run_megatron.sh", *DEMO, *args, f"logging.output_dir={out_dir}"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


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


def entrypoint(out_dir: Path, *args: str) -> str:
    """A Ray job's shell line: the README's Ray line run from the checkout."""
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


def test_ray_run_and_ray_job_equal_the_local_run(cluster: RayCluster, tmp_path: Path) -> None:
    """(a) The README's Ray line, from a terminal and as a Ray job: the metrics of ``NPROC=2 bash run_megatron.sh``,
    one rank per Ray node."""
    t0 = time.monotonic()
    local, on_ray, as_job = tmp_path / "local", tmp_path / "ray", tmp_path / "job"
    runs = [launch(cluster, local, f"demo.num_steps={STEPS}", nproc=2),  # all three at once: the cores stay busy
            launch(cluster, on_ray, *RAY_RUN, f"demo.num_steps={STEPS}")]
    job = submit(cluster, "mrl-equal", as_job, f"demo.num_steps={STEPS}")
    (out, err), (ray_out, ray_err) = [proc.communicate(timeout=400) for proc in runs]
    assert runs[0].returncode == 0, out + err
    assert runs[1].returncode == 0, ray_out + ray_err
    assert job.returncode == 0 and "Job 'mrl-equal' succeeded" in job.stdout, job.stdout[-4000:] + job.stderr
    assert status(cluster, "mrl-equal") == "SUCCEEDED"
    assert len(metrics(local)) == STEPS
    assert metrics(on_ray) == metrics(local)
    assert metrics(as_job) == metrics(local)
    assert "run_megatron.sh: 1 process(es) per node x 2 node(s) on the Ray cluster" in ray_out
    placed = re.search(r"ranks 0-0 on node 0 \(Ray node \S+ (\w+),.*ranks 1-1 on node 1 \(Ray node \S+ (\w+),", ray_out)
    assert placed and placed.group(1) != placed.group(2), ray_out  # STRICT_SPREAD: two Ray nodes
    assert f"step {STEPS}/{STEPS}" in ray_out and "Outputs: " in ray_out  # rank 0's lines, through the driver
    logs = sorted(p.name for p in (on_ray / "ray_logs").iterdir())
    assert logs == ["rank_0.log", "rank_1.log"]
    assert f"step {STEPS}/{STEPS}" in (on_ray / "ray_logs" / "rank_0.log").read_text()
    assert "on the Ray cluster" in job.stdout and f"step {STEPS}/{STEPS}" in job.stdout  # the job's driver, rank 0
    assert cluster.actors("RankProcess") == []  # every actor ended with its driver
    print(f"\nlocal NPROC=2 run, Ray run and Ray job together: {time.monotonic() - t0:.1f} s")


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


def test_ray_job_stop_leaves_nothing_and_the_checkpoint_resumes(cluster: RayCluster, tmp_path: Path) -> None:
    """(c) ``ray job stop``: STOPPED, no process or actor left, the next submission resumes."""
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


def read(pid: int | str) -> tuple[str, bytes, int]:
    """A live process's command line, environment and parent pid (ProcessLookupError for a zombie)."""
    proc = Path("/proc") / str(pid)
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        raise ProcessLookupError(pid)
    cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    return cmdline, (proc / "environ").read_bytes(), int(fields[1])


def ray_node(pid: int) -> str | None:
    """The test cluster's node (``node_a``/``node_b``) whose raylet ``pid`` runs below; None: no raylet above."""
    while pid > 1:
        cmdline, _, pid = read(pid)
        if "/raylet/raylet " in cmdline:
            resources = cmdline.split("--static_resource_list=")[1].split()[0].split(",")
            return next((name for name in NODES if name in resources), None)
    return None


def role(cmdline: str) -> str | None:
    if "megatron_rl.inference.engine_process.vllm_serve" in cmdline:
        return "engine"
    if "megatron_rl.inference.vllm.engine_host" in cmdline:
        return "engine host"
    if "megatron_rl.job.main" in cmdline and "megatron_rl.launch" not in cmdline:
        return "rank"
    return None


def run_processes(out: Path) -> dict[int, tuple[str, str | None, int]]:
    """The run's live ranks, engine hosts and engines (their command line or environment names ``out``): pid ->
    (role, Ray node, parent pid)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline, environ, ppid = read(proc.name)
            kind = role(cmdline)
            if kind and (str(out) in cmdline or str(out).encode() in environ):
                found[int(proc.name)] = (kind, ray_node(int(proc.name)), ppid)
        except (OSError, IndexError):
            continue
    return found


def leftovers(out: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [f"{pid}: {kind}" for pid, (kind, _, _) in run_processes(out).items()] + [
        line for line in ps.splitlines() if any(title in line for title in ACTORS)]


@pytest.mark.engine
@pytest.mark.fleet
def test_the_engine_runs_on_its_own_ray_node_and_a_killed_engine_actor_is_replaced(cluster: RayCluster,
                                                                                     tmp_path: Path) -> None:
    """(d) An engine node on Ray: placement, log-probs, a killed engine actor replaced, nothing left."""
    t0 = time.monotonic()
    out = tmp_path / "run"
    env = cluster.env(PY=sys.executable, NPROC="1", OMP_NUM_THREADS="1", CONFIG="configs/demo_vllm.yaml",
                      MEGATRON_RL_ENGINE_PYTHON=engine_python())
    env.pop(ZYGOTE_ENV, None)  # the engine host starts its engine itself (module docstring)
    args = ["launch.scheduler=ray", "launch.nodes=2", "rollout.engine_nodes=1", "launch.ray.placement_timeout_s=60",
            f"launch.ray.engine_node_resource={NODES[1]}",
            f"logging.output_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "demo.baseline_episodes=0", "checkpoint.save_interval=0", f"demo.num_steps={ENGINE_STEPS}"]
    run = subprocess.Popen(["bash", "run_megatron.sh", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[int, tuple[str, str | None, int]] = {}
    killed = None
    try:
        while run.poll() is None:
            current = run_processes(out)
            now = {pid: info for pid, info in current.items() if pid not in seen}
            seen.update(now)  # each process where it was first seen (an engine whose host was killed is orphaned,
            # with no raylet above it, for the moment until its watchdog ends it)
            wrong = {pid: info for pid, info in now.items()
                     if info[1] != (NODES[0] if info[0] == "rank" else NODES[1])}
            assert not wrong, wrong  # at once: the run would otherwise wait on a misplaced engine
            hosts = [pid for pid, (kind, _, _) in current.items() if kind == "engine host"]
            if killed is None and (out / "metrics.jsonl").exists() and len(hosts) == 1:
                killed = seen[hosts[0]][2]  # the host's actor (it dies, so do its host and engine)
                assert "ray::EngineHostProcess" in read(killed)[0]
                os.kill(killed, signal.SIGKILL)
            assert time.monotonic() - t0 < 600, "the run did not end within 600 s"
            time.sleep(0.5)
        text = run.stdout.read()
        (tmp_path / "driver.out").write_text(text)  # (kept with the run's folder: pytest's basetemp)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, text[-5000:]
    assert killed is not None, "the run ended before its first step's metrics: no engine actor was killed"
    assert "1 process(es) per node x 1 node(s) + 1 engine node(s) (rollout.engine_nodes)" in text, text[-5000:]
    assert "the engine host of engine node 1" in text and "engine host of node 1 started again" in text, text[-5000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, ENGINE_STEPS + 1)), rows
    assert all(row["rollout/logprob_abs_diff_max"] <= TOLERANCE for row in rows), rows
    assert sum(row["rollout/engine_restarts"] for row in rows) >= 1, rows  # the fleet adopted the new engine

    report = "\n".join(f"{pid}: {kind} on {node}" for pid, (kind, node, _) in sorted(seen.items()))
    kinds = {kind: {pid for pid, info in seen.items() if info[0] == kind} for kind in ("rank", "engine host")}
    engines = {pid for pid, (kind, _, ppid) in seen.items()  # the servers (not the processes vLLM forks below them)
               if kind == "engine" and seen.get(ppid, ("",))[0] != "engine"}
    assert len(kinds["rank"]) == 1 and len(kinds["engine host"]) == 2 and len(engines) == 2, report  # replaced
    assert {node for _, node, _ in seen.values()} == set(NODES), report

    deadline = time.monotonic() + 30
    while leftovers(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers(out) == [], "processes of the run outlived it"
    print(f"\nvLLM run with an engine node on Ray, its engine actor killed once: {time.monotonic() - t0:.1f} s")
