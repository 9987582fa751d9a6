"""The engine's processes die with their parent (``vllm_serve.die_with_parent``), without vLLM: a module run with
``-m`` that arms its children as the API server does (and, imported as ``__mp_main__`` by a spawned child, calls
``spawned_child`` as ``vllm_serve`` does), a child and a grandchild started by ``multiprocessing`` (fork, or spawn
as vLLM on CPU does); a SIGKILL of the parent leaves neither (the real engine: ``test_vllm_engine.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import multiprocessing as mp, os, sys, time
from megatron_rl.inference.engine_process import vllm_serve

def grandchild():
    time.sleep(600)

def child(path, method):
    p = mp.get_context(method).Process(target=grandchild)
    p.start()
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {p.pid}")
    os.replace(path + ".tmp", path)
    time.sleep(600)

if __name__ == "__main__":
    if sys.argv[2] == "armed":
        vllm_serve.arm_children()
    method = sys.argv[3]
    mp.get_context(method).Process(target=child, args=(sys.argv[1], method)).start()
    time.sleep(600)
elif __name__ == "__mp_main__" and os.environ.get(vllm_serve.PARENT_ENV):
    vllm_serve.spawned_child()
"""


def _survivors(armed: bool, method: str, tmp_path: Path, wait_s: float) -> list[int]:
    """Start the parent, SIGKILL it once its grandchild runs; the pids still alive ``wait_s`` later (then killed)."""
    pids_file = tmp_path / "pids"
    (tmp_path / "engine_like.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_ENGINE_PARENT"}
    parent = subprocess.Popen([sys.executable, "-m", "engine_like", str(pids_file), "armed" if armed else "plain",
                               method], env={**env, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    deadline = time.monotonic() + 60
    while not pids_file.exists():
        assert parent.poll() is None and time.monotonic() < deadline, "the parent did not start its children"
        time.sleep(0.1)
    pids = [int(p) for p in pids_file.read_text().split()]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_engine_children_die_with_their_parent(method, tmp_path):
    assert _survivors(True, method, tmp_path, wait_s=10) == []


def test_unarmed_children_outlive_their_parent(tmp_path):
    """The reference: without ``arm_children`` both outlive the parent (what the engine's did)."""
    assert len(_survivors(False, "spawn", tmp_path, wait_s=1)) == 2
