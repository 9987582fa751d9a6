"""The real vLLM engine: its weights equal the trainer's export bitwise, it dies with the trainer however the
trainer ends, and a start failure is one error with the engine's log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.inference.vllm.server import RPC_DIR_PREFIX

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


def _trainer(mode: str, hf_dir: Path, work_dir: Path, engine_py: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "MEGATRON_RL_ENGINE_PYTHON": engine_py, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "tests.support.engine_trainer", mode, str(hf_dir), str(work_dir), *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO))


def _alive_in_group(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group ``pgid``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 400, raw: bool = False) -> int | str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}):\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the engine did not start in time")
        time.sleep(0.5)
    time.sleep(0.2)
    return path.read_text() if raw else int(path.read_text())


def _assert_group_gone(pgid: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _alive_in_group(pgid):
        if time.monotonic() > deadline:
            survivors = _alive_in_group(pgid)
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"engine processes {survivors} outlived the trainer")
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["sigint", "error"])  # a SIGKILL of the trainer alone: test_vllm_main_job.py
def test_engine_dies_with_the_trainer(how, engine_hf_model, engine_py, tmp_path):
    proc = _trainer("raise" if how == "error" else "wait", engine_hf_model, tmp_path, engine_py)
    pgid = _wait_for(tmp_path / "engine.pid", proc)
    rpc_dir = None
    if how != "error":  # ("error" raises right after writing the pid: the engine may be gone already)
        assert _alive_in_group(pgid), "the engine should be running"
        rpc_dir = _rpc_dir(pgid)  # vLLM's sockets: in the server's own folder (vllm_serve.py: RPC_DIR_PREFIX)
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)
    elif how == "sigint":
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    _assert_group_gone(pgid)
    assert rpc_dir is None or not rpc_dir.exists(), f"{rpc_dir} outlived its server"


def _rpc_dir(server: int) -> Path:
    """The folder of the Unix sockets that the server's processes bound (vLLM's ZeroMQ ``ipc://`` paths)."""
    folders = {Path(c.laddr).parent for p in [psutil.Process(server), *_descendants(server)]
               for c in p.net_connections(kind="unix") if c.laddr.startswith("/")}
    assert len(folders) == 1 and next(iter(folders)).name.startswith(RPC_DIR_PREFIX), folders
    return folders.pop()


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _assert_gone(processes: list[psutil.Process], what: str, timeout: float = 20) -> None:
    """Every one of ``processes`` ends (or is a zombie) within ``timeout`` seconds; the survivors are killed."""
    def alive() -> list[psutil.Process]:
        return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = alive()
    for p in survivors:
        p.kill()
    assert not survivors, f"{what}: {[(p.pid, p.name()) for p in survivors]} still alive after {timeout:.0f} s"


def test_no_engine_process_outlives_a_kill_of_its_server_or_of_the_run(engine_hf_model, engine_py, tmp_path):
    """Two engines: SIGKILL the API server of engine 0 alone (its EngineCore and Worker must follow it while the
    trainer lives), then the whole run at once, trainer and server 1 (``pkill -9 -f <output_dir>``: the watchdog
    dies too): nothing is left 20 s later either time."""
    proc = _trainer("wait", engine_hf_model, tmp_path, engine_py, "rollout.num_engines=2")
    try:
        servers = [int(p) for p in str(_wait_for(tmp_path / "engine.pid", proc, raw=True)).split()]
        children = {server: _descendants(server) for server in servers}
        assert all(len(c) >= 1 for c in children.values()), children  # EngineCore (+ Worker): vLLM's processes
        os.kill(servers[0], signal.SIGKILL)
        _assert_gone(children[servers[0]], "after a SIGKILL of engine 0's server alone")
        assert proc.poll() is None and psutil.Process(servers[1]).is_running()
        proc.kill()
        os.kill(servers[1], signal.SIGKILL)
        proc.wait(timeout=60)
        _assert_gone(children[servers[1]], "after a SIGKILL of the trainer and the server")
    finally:
        proc.kill()  # (a failed check: the trainer's watchdog then takes the engines with it)


def test_engine_weights_equal_the_trainers_export(engine_hf_model, engine_py, tmp_path):
    proc = _trainer("digests", engine_hf_model, tmp_path, engine_py, "rollout.bucket_mb=0.1")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["engine"] == result["export"]  # every HF tensor, bitwise (sha256 of dtype, shape and bytes)
    assert len(result["engine"]) == 25


def test_start_failure_is_one_error_with_the_engine_log(engine_hf_model, engine_py, tmp_path):
    # a context longer than the model's positions: vLLM refuses it while starting
    proc = _trainer("start", engine_hf_model, tmp_path, engine_py, "rollout.max_model_len=100000")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    error = json.loads(out.strip().splitlines()[-1])["error"]
    assert error is not None and "vLLM engine 0 exited with code" in error, error
    assert "max_model_len" in error  # the engine's own reason, from the tail of its log
    assert str(tmp_path / "engine0.log") in error


def test_missing_engine_environment_names_the_fix(tmp_path):
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.vllm.launcher import engine_python

    with pytest.raises(ValueError, match=r"scripts/setup_engine.sh.*rollout.engine_python"):
        engine_python(RolloutConfig(engine="vllm", engine_python=str(tmp_path / "nope" / "python")))
