"""``run_megatron.sh`` on a real two-node Slurm cluster (``slurm_cluster.py``: slurmctld + two slurmd, one core
each), both ways, against the by-hand two-node launch.

(a) ``launch.scheduler=slurm launch.nodes=2``: the CPU demo (DP2, one rank per node) submitted from here; the
    per-step metrics equal those of the same run launched by hand as two local nodes (NNODES=2, NODE_RANK=0/1);
    each node ran its own launcher (the log's lines);
(b) ``bash run_megatron.sh`` inside a batch script of the user's own (``sbatch --wrap``): the same command as on a
    laptop, one launcher per node through srun; (d) then ``scancel``: no process of the run is left on either node
    (``ps``);
(c) contradictions (``launch.nodes=3`` in a two-node allocation, ...): one line each, exit 2, nothing started;
(f) SIGUSR1 to the batch script reaches every node's launcher; exit 3 -> requeue (or the line that continues it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.cluster.slurm_cluster import SlurmCluster, cluster  # noqa: F401 (the fixture)

from tests.support.job_run import untimed_metrics as metrics
from tests.support.multirank import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
DEMO = ["demo.baseline_episodes=20", "logging.progress_bar=false", "logging.tensorboard=false",
        "parallel.device=cpu", f"demo.num_steps={STEPS}", "checkpoint.save_interval=0"]


def run_env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    return cluster.env(PY=sys.executable, NPROC="1", OMP_NUM_THREADS="1", **extra)


def test_submitted_run_equals_the_run_by_hand(cluster: SlurmCluster, tmp_path: Path) -> None:
    """(a) The README's one line with launch.scheduler=slurm: script written, job id and log printed, log followed
    until the end, exit 0; metrics equal the by-hand two-node run's."""
    t0 = time.monotonic()
    by_hand = tmp_path / "by_hand"
    port = str(free_port())
    nodes = [subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *DEMO, f"logging.output_dir={by_hand}"],
                              cwd=ROOT, env={**run_env(cluster), "NNODES": "2", "NODE_RANK": str(rank),
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = [proc.communicate(timeout=300)[0] for proc in nodes]
    assert [proc.returncode for proc in nodes] == [0, 0], outs
    t1 = time.monotonic()

    submitted = tmp_path / "slurm"
    proc = subprocess.run(["bash", "run_megatron.sh", "launch.scheduler=slurm", "launch.nodes=2", *DEMO,
                           f"logging.output_dir={submitted}"], cwd=ROOT, env=run_env(cluster), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    job_id = out.split("submitted Slurm job ")[1].split()[0]
    script = submitted / "slurm_job.sh"
    assert f"batch script {script}" in out and f"log {submitted / f'slurm-{job_id}.log'}" in out
    assert f"Slurm job {job_id} ended: COMPLETED, exit code 0" in out
    assert "#SBATCH --nodes=2" in script.read_text() and os.access(script, os.R_OK)
    assert "2 node(s) (n[1-2]), one launcher per node with srun" in out  # the in-allocation line, followed
    assert out.count("run_megatron.sh: 1 process(es) per node x 2 node(s)") == 2  # one launcher on each node
    assert metrics(submitted) == metrics(by_hand)
    assert len(metrics(submitted)) == STEPS
    print(f"\nby hand {t1 - t0:.1f} s, submitted {time.monotonic() - t1:.1f} s")


def run_processes(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -ww" not in line]


def test_inside_a_users_own_batch_script_then_scancel(cluster: SlurmCluster, tmp_path: Path) -> None:
    """(b) ``bash run_megatron.sh`` in the user's own sbatch script: one launcher per node, Slurm's values derived;
    (d) ``scancel`` of the running job leaves no launcher, rank or srun of it on either node (``ps``)."""
    out_dir = tmp_path / "own"
    log = tmp_path / "own.log"
    command = " ".join(["bash", str(ROOT / "run_megatron.sh"), *DEMO, "demo.num_steps=1000",
                        f"logging.output_dir={out_dir}"])
    job_id = cluster.run("sbatch", "--parsable", "--nodes=2", f"--output={log}", f"--chdir={tmp_path}",
                         f"--export=ALL,PY={sys.executable},NPROC=1", f"--wrap={command}").strip()
    deadline = time.monotonic() + 240
    while not (out_dir / "metrics.jsonl").exists():  # the ranks are training on both nodes
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(1)
    text = log.read_text()
    assert text.count("run_megatron.sh: 1 process(es) per node x 2 node(s)") == 2, text
    assert f"Slurm job {job_id}: 2 node(s) (n[1-2]), one launcher per node with srun" in text
    assert len(run_processes(str(out_dir))) >= 4, text  # a launcher and a rank per node at least
    cluster.run("scancel", job_id)
    assert cluster.wait_job(job_id)["JobState"] == "CANCELLED"
    deadline = time.monotonic() + 30
    while run_processes(str(out_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run_processes(str(out_dir)) == []


def test_contradictions_are_one_line(cluster: SlurmCluster, tmp_path: Path) -> None:
    """(c) In the user's own script: ``launch.nodes=3`` in a two-node allocation, ``NNODES=1`` there; through our
    submission (``launch.follow=false``): ``launch.nodes=1`` while an extra ``#SBATCH --nodes=2`` wins. One line
    each, exit 2, no rank started."""
    log = tmp_path / "contra.log"
    launcher = str(ROOT / "run_megatron.sh")
    command = (f"bash {launcher} launch.nodes=3 parallel.device=cpu; echo exit=$?; "
               f"NNODES=1 bash {launcher} parallel.device=cpu; echo exit=$?")
    job_id = cluster.run("sbatch", "--parsable", "--nodes=2", f"--output={log}",
                         f"--export=ALL,PY={sys.executable}", f"--wrap={command}").strip()
    cluster.wait_job(job_id)
    lines = [line for line in log.read_text().splitlines() if not line.startswith("base config: ")]
    assert lines == [
        f"run_megatron.sh: launch.nodes=3 but this Slurm allocation (job {job_id}) has 2 node(s); remove launch.nodes "
        "(it is derived) or ask Slurm for 3 (sbatch/salloc --nodes=3)", "exit=2",
        f"run_megatron.sh: NNODES=1 but this Slurm allocation (job {job_id}) has 2 node(s); unset NNODES (it is "
        "derived from Slurm)", "exit=2"], lines

    out_dir = tmp_path / "ours"
    proc = subprocess.run(["bash", "run_megatron.sh", "launch.scheduler=slurm", "launch.follow=false", "launch.nodes=1",
                           "launch.slurm.extra=[--nodes=2]", "parallel.device=cpu", f"logging.output_dir={out_dir}"],
                          cwd=ROOT, env=run_env(cluster), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("submitted Slurm job ")[1].split()[0]
    assert f"cancel it with: scancel {job_id}" in proc.stdout  # returned at once
    fields = cluster.wait_job(job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    text = (out_dir / f"slurm-{job_id}.log").read_text()
    assert (f"run_megatron.sh: launch.nodes=1 but this Slurm allocation (job {job_id}) has 2 node(s)" in text
            and "process(es) per node" not in text), text


def test_ctrl_c_while_following_cancels_nothing(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) while following a job's log: one line says how to cancel and follow again; the job runs on."""
    log = tmp_path / "sleep.log"
    job_id = cluster.run("sbatch", "--parsable", f"--output={log}", "--wrap=echo started; sleep 60").strip()
    follower = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from megatron_rl.launch."
                                 f"submit import follow; sys.exit(follow({job_id!r}, Path({str(log)!r})))"],
                                env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                # SIGINT at its default, as in a terminal: a pytest started in the background
                                # (`... &` without job control) passes its children SIGINT ignored
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while "started" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(2)  # the follower has printed the log's first line
    follower.send_signal(signal.SIGINT)
    out = follower.communicate(timeout=30)[0]
    assert follower.returncode == 130, out
    assert out.splitlines()[0] == "started", out
    assert (f"Slurm job {job_id} keeps running. Cancel it with: scancel {job_id}; follow it again with: tail -f "
            f"{log}") in out, out
    assert "JobState=RUNNING" in cluster.run("scontrol", "show", "job", "-o", job_id)
    cluster.run("scancel", job_id)


STAND_IN = """#!/bin/bash
# A stand-in for run_megatron.sh with the preemption contract (the launchers save and exit 3 on SIGUSR1): srun with
# our options starts it once per node; on USR1 node 1 takes a second longer than node 0 to "save".
if [ -z "${STAND_IN_STEP:-}" ]; then
  export STAND_IN_STEP=1; exec srun --nodes=2 --ntasks=2 %(srun)s bash "$0" "$@"
fi
mark=$1/restart-${SLURM_RESTART_COUNT:-0}-node-$SLURM_NODEID
trap 'touch $mark.usr1; sleep $SLURM_NODEID; exit 3' USR1
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then touch $mark.resumed; exit 0; fi
touch $mark.started
for i in $(seq 600); do sleep 0.1; done
exit 1
"""


@pytest.mark.parametrize("requeue", [True, False])
def test_preemption_signal_reaches_every_node_then_requeue(cluster: SlurmCluster, tmp_path: Path,
                                                           requeue: bool) -> None:
    """SIGUSR1 to the batch script (as ``--signal=B:USR1@<s>`` sends it) reaches the launcher of each node through
    srun; both exit 3 -> requeued and run again (``launch.slurm.requeue``), or one line with the command that
    continues the run."""
    from megatron_rl.job.launch_config import SlurmConfig
    from megatron_rl.launch import batch_script
    from megatron_rl.launch.plan import SRUN_OPTIONS

    stand_in = tmp_path / "stand_in.sh"
    stand_in.write_text(STAND_IN % {"srun": " ".join(SRUN_OPTIONS)})
    job = batch_script.BatchJob(nodes=2, slurm=SlurmConfig(requeue=requeue), output_dir=tmp_path, workdir=tmp_path,
                                launcher=stand_in, args=(str(tmp_path),), env=())
    script = tmp_path / batch_script.SCRIPT_NAME
    script.write_text(batch_script.render(job))
    job_id = cluster.run("sbatch", "--parsable", str(script)).strip()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("restart-0-node-*.started"))) < 2:
        assert time.monotonic() < deadline, "the stand-in did not start on both nodes"
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    # a requeued job is held 6 s (the test cluster's cred_expire + 1: slurm_cluster.py), then runs again (cutting
    # the hold short with StartTime=now can fail the launch: docs/CLUSTER.md, "Preemption and requeue")
    fields = cluster.wait_job(job_id, timeout=120)
    log = (tmp_path / f"slurm-{job_id}.log").read_text() + cluster.report(job_id)
    assert sorted(p.name for p in tmp_path.glob("restart-0-*.usr1")) == ["restart-0-node-0.usr1",
                                                                          "restart-0-node-1.usr1"], log
    if requeue:
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, log)
        assert len(list(tmp_path.glob("restart-1-node-*.resumed"))) == 2, log
        assert "requeueing job" in log
    else:
        assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0", (fields, log)
        assert f"continue it with: sbatch {script}" in log
