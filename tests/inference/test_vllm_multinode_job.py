"""The main job on two simulated nodes (two torchrun launchers on this machine, one rank each, ``NNODES=2``) with
``rollout.num_engines=2`` (``configs/demo_vllm.yaml``): each node's local rank 0 starts its own engine (engine i on
node i % nnodes, ``inference/nodes.py``), under a watchdog on its own pid and with its log in the work dir; global
rank 0 routes over both; the node-1 engine killed mid-run costs a restart (node 1 starts the replacement) and the
run completes. Not checked here: the replacement serving again (it did not within 200 steps in one try)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multirank import free_port
from test_vllm_main_job import _engine_pids, _rows, _wait_rows

pytestmark = [pytest.mark.engine, pytest.mark.multirank, pytest.mark.fleet]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 14
TOLERANCE = 1e-4  # as in test_vllm_sync.py


def _launch_node(out: Path, engine_py: str, node: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PY": sys.executable, "MEGATRON_RL_ENGINE_PYTHON": engine_py, "CONFIG": "configs/demo_vllm.yaml",
           "NPROC": "1", "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
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
        texts = [node.communicate(timeout=400)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], texts
        rows = _rows(out)
        assert [row["step"] for row in rows][-1] == STEPS, texts[0]
        assert sum(row["rollout/engine_restarts"] for row in rows) > 0, texts[0]
        assert all(row["rollout/logprob_abs_diff_max"] <= TOLERANCE for row in rows)  # replacement: current weights
        assert "engine 1" in texts[0] and "its node restarts it" in texts[0], texts[0]
        assert not _engine_pids(out)  # every node's engines ended with the run
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
