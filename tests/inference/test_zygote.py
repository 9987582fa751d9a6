"""The engine zygote (megatron_rl/inference/engine_process/zygote.py): a server forked from it is the server a plain start gives,
and nothing it forked outlives the process that started it.

- the same seeded samples, token for token and log-prob for log-prob, from a forked server and from a plain
  ``python -m megatron_rl.inference.engine_process.vllm_serve`` start, here the start that follows a forked server that did not
  answer in time (``server.FORKED_START_S``, set to 1 s); ``ps`` shows the plain start's command line for both;
- a zygote whose parent is SIGKILLed exits and takes the servers it holds with it (the trainer's own death is
  tests/inference/test_vllm_engine.py's, which runs through the session's zygote);
- a request the zygote cannot serve (another interpreter) starts the usual way, saying why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.inference.vllm import server as server_module
from megatron_rl.inference.engine_process import zygote
from megatron_rl.inference.engine import SamplingSpec
from megatron_rl.inference.vllm.server import EngineServer, ServeOptions, start_zygote

pytestmark = pytest.mark.engine

SPEC = SamplingSpec(max_tokens=8, temperature=1.0, stop_token_ids=(2,))


def _options(engine_py: str) -> ServeOptions:
    return ServeOptions(python=engine_py, dtype="float32", max_model_len=256, seed=0, kv_cache_gib=1,
                        gpu_memory_utilization=0.5)


def _samples(server: EngineServer) -> list:
    """Also: vLLM's ZeroMQ sockets and its rendezvous file (W49) are in the server's own folder, removed with the
    server (``RPC_DIR_PREFIX``)."""
    rpc_dir = Path(server._plain_start[1]["VLLM_RPC_BASE_PATH"])
    try:
        server.wait_ready(300)
        title = " ".join(psutil.Process(server.proc.pid).cmdline())
        assert "-m megatron_rl.inference.engine_process.vllm_serve" in title and "--port" in title, title
        assert rpc_dir.name.startswith(server_module.RPC_DIR_PREFIX) and any(rpc_dir.iterdir()), rpc_dir
        assert list(rpc_dir.glob("vllm_dist_*")), sorted(p.name for p in rpc_dir.iterdir())
        return [(c.token_ids, c.logprobs) for c in server.sample([1, 5, 7, 9], SPEC, seed=11, n=3, timeout_s=60)]
    finally:
        server.kill()
        assert not rpc_dir.exists()


def test_a_forked_server_samples_what_a_plain_start_samples(engine_hf_model, engine_py, tmp_path, monkeypatch,
                                                            capfd):
    """The second server is forked too, but given 1 s to answer (``FORKED_START_S``): it is killed and started the
    usual way, which is then the plain start compared with the first."""
    socket_path = tmp_path / "z.sock"
    held = start_zygote(engine_py, socket_path, tmp_path / "zygote.log")
    try:
        monkeypatch.setenv(zygote.ZYGOTE_ENV, str(socket_path))
        forked = EngineServer.start(engine_hf_model, _options(engine_py), token="t", log_path=tmp_path / "f.log")
        assert isinstance(forked.proc, zygote.ZygoteChild)
        from_fork = _samples(forked)
        assert forked.proc.returncode == -signal.SIGKILL and not forked.alive()
        monkeypatch.setattr(server_module, "FORKED_START_S", 1.0)
        plain = EngineServer.start(engine_hf_model, _options(engine_py), token="t", log_path=tmp_path / "p.log")
        assert isinstance(plain.proc, zygote.ZygoteChild)
        from_plain = _samples(plain)
        assert isinstance(plain.proc, subprocess.Popen)
        assert "(forked by the engine zygote) did not answer within 1 s: starting it the usual way" in capfd.readouterr().err
        assert from_plain == from_fork  # bitwise: the same floats
    finally:
        held.kill()


_HOLDER = """
import os, sys, time
from pathlib import Path
from megatron_rl.inference.vllm import server as server_module
from megatron_rl.inference.engine_process import zygote
from megatron_rl.inference.vllm.server import EngineServer, ServeOptions, start_zygote
python, model, folder = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
held = start_zygote(python, folder / "z.sock", folder / "zygote.log")
os.environ[zygote.ZYGOTE_ENV] = str(folder / "z.sock")
options = ServeOptions(python=python, dtype="float32", max_model_len=256, seed=0, kv_cache_gib=1,
                       gpu_memory_utilization=0.5)
server = EngineServer.start(model, options, token="t", log_path=folder / "e.log")
print(held.pid, server.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_zygote_and_its_servers_die_with_the_zygotes_parent(engine_hf_model, engine_py, tmp_path):
    """The holder starts a zygote and one server (the server is also the holder's own: its watchdog and lifeline
    point at the holder); SIGKILL of the holder leaves nothing of either 20 s later."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, engine_py, str(engine_hf_model), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        zygote_pid, server_pid = map(int, holder.stdout.readline().split())
        processes = [psutil.Process(zygote_pid), psutil.Process(server_pid)]
        time.sleep(3)  # the server is busy starting (importing nothing: forked)
        processes += psutil.Process(server_pid).children(recursive=True)
    finally:
        holder.kill()
    holder.wait()
    deadline = time.monotonic() + 20
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    for p in alive:
        p.kill()
    assert not alive, f"{[(p.pid, p.name()) for p in alive]} outlived the holder"


def test_a_zygote_of_another_interpreter_is_refused(tmp_path, monkeypatch, capfd):
    """No zygote needed: the hello names another interpreter, so ``spawn`` refuses and the start goes on plainly."""
    import socket
    import threading

    path = str(tmp_path / "z.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def hello() -> None:
        connection, _ = listener.accept()
        connection.sendall(b"{\"python\": \"/elsewhere/python\", \"env\": {}, \"set_by_imports\": {}}\n")
        connection.recv(1)
        connection.close()

    threading.Thread(target=hello, daemon=True).start()
    with pytest.raises(zygote.ZygoteUnavailable, match="/elsewhere/python"):
        zygote.spawn(path, sys.executable, ["--version"], dict(os.environ), os.getcwd(), 1)
    listener.close()
