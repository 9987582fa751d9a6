"""The main job on two simulated nodes (two torchrun launchers on this machine, one rank each, ``NNODES=2``) with
``rollout.num_engines=2`` (``configs/demo_vllm.yaml``): each node's local rank 0 starts its own engine (engine i on
node i % nnodes, ``inference/nodes.py``), under a watchdog on its own pid and with its log in the work dir; global
rank 0 routes over both; the node-1 engine killed mid-run costs a restart: node 1 starts the replacement, which
serves again with the current weights; a SIGKILL of both nodes' jobs leaves no engine. The simulated nodes share
this machine's cores: each node's engine is pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``), else both
would bind core 0 (each node thinks the cores are its own) and a replacement starves behind the other's spinning
worker."""

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
STEPS = 2000  # never reached: the test stops the run once the replacement serves
TOLERANCE = 1e-4  # as in test_vllm_sync.py


def _launch_node(out: Path, engine_py: str, node: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PY": sys.executable, "MEGATRON_RL_ENGINE_PYTHON": engine_py, "CONFIG": "configs/demo_vllm.yaml",
           "NPROC": "1", "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "VLLM_CPU_OMP_THREADS_BIND": str(node % (os.cpu_count() or 1))}
    env[ZYGOTE_ENV] = "off"  # each node's rank starts its engines itself (no zygote): their parent is that rank
    args = [f"logging.output_dir={out}", "logging.progress_bar=false", "demo.baseline_episodes=0",
            "checkpoint.save_interval=1000", "rollout.num_engines=2", f"demo.num_steps={STEPS}"]
    return subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _environ(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _engines_by_node(out: Path) -> dict[int, int]:
    """Node (GROUP_RANK of the watchdog's pid) -> the engine's API-server pid, for this run's live engines."""
    found = {}
    for pid in _engine_pids(out):
        args = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
        parent = int(args[args.index("--parent-pid") + 1])
        ppid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid == parent  # the watchdog watches the rank that started the engine
        found[int(_environ(parent)["GROUP_RANK"])] = pid
    return found


def test_each_node_starts_its_engines_and_restarts_them(engine_py, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    nodes = [_launch_node(out, engine_py, node, port) for node in (0, 1)]
    try:
        _wait_rows(out, nodes[0], lambda rows: len(rows) >= 2, "reach step 2")
        engines = _engines_by_node(out)
        assert sorted(engines) == [0, 1], engines
        log = os.readlink(f"/proc/{engines[1]}/fd/1")
        assert log == str(out / "engine" / "engine1.log"), log  # engine 1 (i % 2 == 1) runs on node 1
        assert os.readlink(f"/proc/{engines[0]}/fd/1") == str(out / "engine" / "engine0.log")
        assert _rows(out)[-1]["rollout/engines_alive"] == 2.0  # rank 0 routes over both nodes' engines

        os.killpg(engines[1], signal.SIGKILL)  # the engine leads its own process group
        killed_at = len(_rows(out))
        rows = _wait_rows(out, nodes[0], lambda rows: len(rows) > killed_at and any(
            r["rollout/engines_alive"] == 2.0 for r in rows[killed_at:]), "serve with both nodes' engines again", 600)
        assert sum(row["rollout/engine_restarts"] for row in rows) >= 1
        assert all(row["rollout/logprob_abs_diff_max"] <= TOLERANCE for row in rows)  # replacement: current weights
        back = _engines_by_node(out)
        assert sorted(back) == [0, 1] and back[1] != engines[1], back  # node 1 started the replacement
        job = set().union(*(_descendants(node.pid) for node in nodes))
        for pid in _job_pids(out):  # every rank (torchrun gives each its own process group), then the launchers
            os.kill(pid, signal.SIGKILL)
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)
        text = nodes[0].communicate(timeout=60)[0]
        assert "engine 1" in text and "its node restarts it" in text, text
        deadline = time.monotonic() + 30
        while _alive(job):  # the watchdogs: no engine outlives the rank that started it, nor anything else
            assert time.monotonic() < deadline, f"processes of the killed job outlived it: {sorted(_alive(job))}"
            time.sleep(0.5)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
