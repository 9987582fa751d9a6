"""``rollout.engine_nodes=1``: the vLLM demo (``configs/demo_vllm.yaml``) on two simulated nodes (two launchers on this
machine): node 0 runs the trainer (one rank, world size 1), node 1 runs the engine host and the engine, no rank.
The engine killed mid-run is replaced by node 1's host (the fleet's healing) and serves again with the current
weights; then SIGUSR1 to both launchers (a Slurm preemption warning) stops the job at a step boundary with a
checkpoint, exit code 3 on both nodes, and leaves no process. Cost: one vLLM job of a few steps plus one engine
restart: 141 s and 192 s measured on the 2-core machine while other jobs ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support.multirank import free_port
from megatron_rl.inference.engine_process.zygote import ZYGOTE_ENV
from tests.job.test_vllm_main_job import _alive, _descendants, _engine_pids, _job_pids, _rows, _wait_rows

pytestmark = [pytest.mark.engine, pytest.mark.multirank, pytest.mark.fleet]

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # as in test_vllm_sync.py


def _launch_node(out: Path, engine_py: str, node: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PY": sys.executable, "MEGATRON_RL_ENGINE_PYTHON": engine_py, "CONFIG": "configs/demo_vllm.yaml",
           "NPROC": "1", "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop(ZYGOTE_ENV, None)  # the engine host starts its engine itself: its parent is the host (below)
    args = [f"logging.output_dir={out}", "logging.progress_bar=false", "demo.baseline_episodes=0",
            "checkpoint.save_interval=1000", "rollout.engine_nodes=1", "demo.num_steps=2000"]
    return subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ranks(out: Path) -> list[int]:
    """The trainer's rank processes (not their launcher, whose command line names the job's module too)."""
    return [pid for pid in _job_pids(out)
            if b"megatron_rl.job.start" not in (Path("/proc") / str(pid) / "cmdline").read_bytes()]


def _parent_of(pid: int) -> int:
    args = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    return int(args[args.index("--parent-pid") + 1])


def test_the_engine_runs_on_its_own_node_is_healed_there_and_stops_with_the_job(engine_py, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    nodes = [_launch_node(out, engine_py, node, port) for node in (0, 1)]
    try:
        _wait_rows(out, nodes[0], lambda rows: len(rows) >= 2, "reach step 2")
        engines, ranks = _engine_pids(out), _ranks(out)
        assert len(engines) == 1 and len(ranks) == 1, (engines, ranks)
        assert _parent_of(engines[0]) == nodes[1].pid  # started by node 1's engine host (run_megatron.sh exec'd it)
        assert engines[0] in _descendants(nodes[1].pid) and ranks[0] in _descendants(nodes[0].pid)
        assert not set(ranks) & _descendants(nodes[1].pid)  # no trainer rank on the engine node
        assert os.readlink(f"/proc/{engines[0]}/fd/1") == str(out / "engine" / "engine0.log")

        os.killpg(engines[0], signal.SIGKILL)  # the engine leads its own process group
        killed_at = len(_rows(out))
        rows = _wait_rows(out, nodes[0], lambda rows: len(rows) > killed_at and any(
            r["rollout/engine_restarts"] >= 1 for r in rows[killed_at:]) and rows[-1]["rollout/engines_alive"] == 1.0,
            "serve with a replacement engine", 600)
        assert all(row["rollout/logprob_abs_diff_max"] <= TOLERANCE for row in rows)  # replacement: current weights
        back = _engine_pids(out)
        assert len(back) == 1 and back[0] != engines[0] and _parent_of(back[0]) == nodes[1].pid, back

        job = set().union(*(_descendants(node.pid) for node in nodes)) | {node.pid for node in nodes}
        for node in nodes:  # a preemption warning to every node's launcher, as the Slurm script forwards it
            os.killpg(node.pid, signal.SIGUSR1)
        texts = [node.communicate(timeout=300)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [3, 3], texts[0][-3000:] + texts[1][-3000:]
        assert "megatron_rl: stopped on SIGUSR1 after step" in texts[0], texts[0][-3000:]
        assert "is down" in texts[0] and "is back" in texts[0], texts[0][-3000:]
        assert list((out / "checkpoints").glob("step_*")), "no checkpoint"
        deadline = time.monotonic() + 30
        while _alive(job):  # the host killed its engine on the way out; nothing else is left either
            assert time.monotonic() < deadline, f"processes of the job outlived it: {sorted(_alive(job))}"
            time.sleep(0.5)
        assert not _engine_pids(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
