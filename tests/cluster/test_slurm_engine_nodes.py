"""``rollout.engine_nodes=1`` on the real two-node Slurm cluster (``slurm_cluster.py``): the vLLM demo
(``configs/demo_vllm.yaml``, two steps) submitted with ``launch.scheduler=slurm launch.nodes=2`` trains to the end
(exit 0, both steps' metrics, the engine's log-probs equal to the trainer's within the bound of
``tests/job/test_engine_nodes_job.py``); its vLLM engine ran on the second Slurm node (``n2``), below that
node's engine host, and no trainer rank did (every process's ``SLURMD_NODENAME``, read from ``/proc/<pid>/environ``
while the job runs); afterwards no process of the run is left on either node (``ps``).

The engine is started by the engine host on ``n2`` itself, not forked from the test session's zygote
(``tests/support/engine_zygote.py``): a zygote's engine would run outside the allocation. Cost: one submitted vLLM job of
two steps with a plain engine start on one core per node: 81-100 s on the 2-core machine (210 s while other helpers' jobs ran).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from tests.support.engine_env import engine_python
from tests.cluster.slurm_cluster import SlurmCluster, cluster  # noqa: F401 (the fixture)
from tests.cluster.test_slurm_launch import ROOT, run_processes, run_env

from megatron_rl.inference.engine_process.zygote import ZYGOTE_ENV

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.engine, pytest.mark.fleet]

STEPS = 2
ENGINE_WITHIN_S = 300
"""The engine has started on n2 by then (~60 s measured under load); without one the trainer would wait for it."""
TOLERANCE = 1e-4  # as in tests/job/test_engine_nodes_job.py (and test_vllm_sync.py)


Seen = tuple[str, "str | None", tuple[str, "str | None"]]


def where(pid: int | str) -> tuple[str, str | None, int]:
    """A live process's command line, the Slurm node it runs on (``SLURMD_NODENAME``) and its parent pid."""
    proc = Path("/proc") / str(pid)
    cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        raise ProcessLookupError(pid)
    environ = (proc / "environ").read_bytes().split(b"\0")
    node = next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURMD_NODENAME=")), None)
    return cmdline, node, int(fields[1])


def processes(out: Path) -> dict[int, Seen]:
    """Live processes of this run (their command line names its output folder): pid -> (command line, node,
    (the parent's command line, the parent's node))."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(out).encode() not in (proc / "cmdline").read_bytes():
                continue
            cmdline, node, parent = where(proc.name)
            parent_cmdline, parent_node, _ = where(parent)
        except OSError:
            continue
        found[int(proc.name)] = (cmdline, node, (parent_cmdline, parent_node))
    return found


def is_engine(cmdline: str) -> bool:
    """An engine server process, or one vLLM forked from it (its title until vLLM renames it)."""
    return "vllm_serve" in cmdline


def is_rank(cmdline: str) -> bool:
    """A trainer rank (torchrun's launcher and ``run_megatron.sh`` name the job's module too, or its output)."""
    return "megatron_rl.job.main" in cmdline and "megatron_rl.job.start" not in cmdline and "torchrun" not in cmdline


def misplaced(seen: dict[int, Seen]) -> list[str]:
    """Processes on the wrong node: a trainer rank on the engine node, an engine on the trainer's node."""
    return [f"{pid} on {node}: {cmd[:150]}" for pid, (cmd, node, _) in sorted(seen.items())
            if (is_rank(cmd) and node != "n1") or (is_engine(cmd) and node != "n2")]


def test_the_engine_runs_on_the_second_slurm_node_and_no_rank_does(cluster: SlurmCluster, tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = tmp_path / "run"
    env = run_env(cluster, CONFIG="configs/demo_vllm.yaml", MEGATRON_RL_ENGINE_PYTHON=engine_python())
    env.pop(ZYGOTE_ENV, None)  # the engine host on n2 starts its engine itself (module docstring)
    args = ["launch.scheduler=slurm", "launch.nodes=2", "rollout.engine_nodes=1", f"logging.output_dir={out}",
            "logging.progress_bar=false", "logging.tensorboard=false", "demo.baseline_episodes=0",
            "checkpoint.save_interval=0", f"demo.num_steps={STEPS}"]
    submit = subprocess.Popen(["bash", "run_megatron.sh", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    seen: dict[int, Seen] = {}
    try:
        while submit.poll() is None:  # where each process of the run runs, while it runs
            seen.update(processes(out))
            assert not misplaced(seen), misplaced(seen)  # at once: a trainer on n2 would wait for its engine
            assert (any(is_engine(cmd) for cmd, _, _ in seen.values())
                    or time.monotonic() - t0 < ENGINE_WITHIN_S), f"no engine started within {ENGINE_WITHIN_S} s"
            assert time.monotonic() - t0 < 600, "the submitted job did not end within 600 s"
            time.sleep(0.5)
        text = submit.stdout.read()
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 0, text[-5000:]
    job_id = text.split("submitted Slurm job ")[1].split()[0]
    assert f"Slurm job {job_id} ended: COMPLETED, exit code 0" in text, text[-5000:]
    assert "node 1 of 2 is an engine node (rollout.engine_nodes=1)" in text, text[-5000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), rows
    assert all(row["rollout/logprob_abs_diff_max"] <= TOLERANCE for row in rows), rows

    report = "\n".join(f"{pid} on {node}: {cmd[:150]} (parent on {parent[1]}: {parent[0][:80]})"
                       for pid, (cmd, node, parent) in sorted(seen.items()))
    assert {node for cmd, node, _ in seen.values() if is_engine(cmd)} == {"n2"}, report
    engines = {pid: info for pid, info in seen.items() if is_engine(info[0]) and not is_engine(info[2][0])}
    ranks = {pid: info for pid, info in seen.items() if is_rank(info[0])}
    assert len(engines) == 1 and len(ranks) == 1, report
    [(_, engine_node, (parent_cmdline, parent_node))] = engines.values()
    assert "megatron_rl.inference.vllm.engine_host" in parent_cmdline and parent_node == "n2", report  # n2's host
    assert [node for _, node, _ in ranks.values()] == ["n1"], report  # the trainer's rank, and none on n2

    deadline = time.monotonic() + 30
    while run_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run_processes(str(out)) == [], "processes of the run outlived it"
    print(f"\nsubmitted vLLM job with an engine node: {time.monotonic() - t0:.1f} s")
