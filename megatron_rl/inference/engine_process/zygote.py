"""An engine zygote: one process that has imported vLLM once and forks each CPU engine server from there.

Why: a ``vllm serve`` start on the 2-core machine is ~17 s, ~11 of them importing vLLM (torch, TorchDynamo,
the quantization layers, transformers: docs/TESTING.md section 1). A server forked from a process that has
imported it already serves in ~6 s. The test suite starts one zygote per session (``tests/conftest.py``) and its
~40 engine starts fork from it; a job uses it where ``$MEGATRON_RL_ENGINE_ZYGOTE`` names its socket
(``EngineServer.start``, which starts a server the usual way without one, or when the zygote cannot serve it).

Place in the data flow: ``EngineServer.start`` (trainer rank 0) -> ``spawn`` (here, the trainer's environment:
stdlib only) -> over a Unix socket -> ``serve`` (here, the engine's environment, ``python -m
megatron_rl.inference.engine_process.zygote --socket PATH --parent-pid PID``) forks -> ``vllm_serve.main`` in the
child, with the argv, environment, working directory and log file the plain start would have given it
(``python -m megatron_rl.inference.engine_process.vllm_serve ...``, also the title ``ps`` shows).

What the forked server keeps of the plain start's guarantees:
- **Its own session and log**: the child calls ``setsid`` (``EngineServer.kill`` kills the group, as for a plain
  start); the log file is opened by the trainer and passed over the socket (``SCM_RIGHTS``), so it is the server's
  fd 1 and 2 as before.
- **It dies with the trainer**: ``vllm_serve``'s watchdog (``--parent-pid``, the trainer) runs in the child as in
  a plain start; besides, each spawn keeps its connection open, and the zygote kills the child's group as soon as
  that connection closes (the trainer exited or was killed). The zygote itself exits, killing its children, when
  its own parent (the test session) is gone.
- **The trainer sees a process**: ``ZygoteChild`` answers ``pid``, ``poll``, ``wait`` and ``returncode`` as
  ``subprocess.Popen`` does (the zygote reaps the child and sends its exit status over the connection).

What it does not cover (a plain start then, chosen in ``EngineServer.start``): GPU engines (a forked CUDA context
is unusable; CUDA vLLM is the GPU path and starts the usual way), another engine interpreter than the zygote's,
and an environment that differs from the zygote's in a variable read at import time (``IMPORT_TIME_ENV``: what
vLLM, torch, OpenMP or Hugging Face read when imported would be stale in a fork).
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

ZYGOTE_ENV = "MEGATRON_RL_ENGINE_ZYGOTE"
"""The path of the zygote's Unix socket; unset or ``ZYGOTE_OFF``: every engine starts the usual way (a job's
launcher starts one for its CPU engines where it is unset: ``inference/vllm/job_zygote.py``)."""
ZYGOTE_OFF = "off"

IMPORT_TIME_ENV = ("VLLM_", "OMP_", "KMP_", "GOMP_", "MKL_", "LD_", "TORCH_LOGS", "TORCH_CPP", "TORCHDYNAMO",
                   "TORCHINDUCTOR", "PYTORCH", "CUDA", "PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS")
"""Prefixes of the variables that may be read at import time (by vLLM's logging, OpenMP's runtime as it loads,
torch's logging and compiler configs, the interpreter, Hugging Face's constants): a request whose values differ
from the zygote's (but for ``PER_ENGINE_ENV``) starts the usual way. torchrun's ``TORCHELASTIC_*`` and
``TORCH_NCCL_*``, which a job's engines inherit, are read by a distributed run only."""

PER_ENGINE_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                  "VLLM_SERVER_DEV_MODE", "VLLM_RPC_BASE_PATH", "PYTHONUNBUFFERED")
"""Read when the server runs, not at import (vLLM's ``envs`` are looked up lazily; ``vllm_serve`` sets OpenMP's
thread count and binding itself in the child, as in a plain start)."""

_IMPORTS = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server",
            "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.executor.uniproc_executor",
            "vllm.v1.worker.cpu_worker", "vllm.model_executor.models.qwen3",
            "megatron_rl.inference.engine_process.vllm_worker")
"""What the zygote imports before it serves (a module a vLLM version lacks is skipped)."""


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in PER_ENGINE_ENV}


# ------------------------------------------------------------------------------------------ trainer side
class ZygoteUnavailable(RuntimeError):
    """The zygote cannot start this server (none listening, another interpreter or import-time environment)."""


class ZygoteChild:
    """A server forked by the zygote, seen as ``subprocess.Popen`` sees a child (``pid``, ``poll``, ``wait``,
    ``returncode``). Its connection to the zygote is its lifeline: closing it (``close``, or the trainer's exit)
    makes the zygote kill the server's process group."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock: socket.socket | None = sock
        self.pid = pid
        self.returncode: int | None = None

    def _read_status(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the zygote's word on the server: its exit status, or (the zygote is gone)
        whether the server still runs."""
        if self._sock is None:  # the zygote is gone: the process is all there is to ask
            if not _alive(self.pid):
                self.returncode = -signal.SIGKILL
            else:
                time.sleep(min(timeout, 0.1))
            return
        if not select.select([self._sock], [], [], timeout)[0]:
            return
        data = self._sock.recv(4096)
        self._sock.close()
        self._sock = None
        if data:
            self.returncode = int(json.loads(data.decode())["returncode"])

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"engine server {self.pid}", timeout or 0)
            self._read_status(left)
        return self.returncode  # type: ignore[return-value]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not running
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def spawn(socket_path: str, python: str, argv: list[str], env: dict[str, str], cwd: str, log_fd: int,
          timeout_s: float = 30.0) -> ZygoteChild:
    """Ask the zygote at ``socket_path`` for ``python -m megatron_rl.inference.engine_process.vllm_serve *argv``
    with ``env``, ``cwd`` and ``log_fd`` as stdout and stderr. ``ZygoteUnavailable`` (nothing started) when it
    cannot."""
    _wait_until_serving(socket_path, timeout_s=120)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_path)
        hello = json.loads(_recv_line(sock))
        if hello["python"] != python:
            raise ZygoteUnavailable(f"the zygote runs {hello['python']}, not {python}")
        ours, before, imported = import_time_env(env), hello["env"], hello["set_by_imports"]
        keys = sorted(k for k in set(ours) | set(before) if ours.get(k) != before.get(k)
                      and not (k in imported and ours.get(k) == imported[k]))  # (the import would set it so)
        if keys:
            raise ZygoteUnavailable(f"import-time environment differs from the zygote's: {', '.join(keys)}")
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
        sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [log_fd]))])
        answer = json.loads(_recv_line(sock))
        if "pid" not in answer:
            raise ZygoteUnavailable(f"the zygote refused: {answer.get('error')}")
    except (OSError, ValueError, KeyError) as err:
        sock.close()
        raise ZygoteUnavailable(f"no zygote at {socket_path}: {type(err).__name__}: {err}") from None
    except ZygoteUnavailable:
        sock.close()
        raise
    sock.settimeout(None)
    return ZygoteChild(sock, int(answer["pid"]))


def _wait_until_serving(socket_path: str, timeout_s: float) -> None:
    """A zygote still importing (its pid in ``<socket>.pid``, written by whoever started it) is waited for."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path) and time.monotonic() < deadline:
        try:
            with open(f"{socket_path}.pid") as file:
                starting = int(file.read().strip() or 0)
        except (OSError, ValueError):
            return
        if not starting or not _alive(starting):
            return
        time.sleep(0.2)


def _recv_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the zygote closed the connection")
        data += chunk
    return data.decode()


# ------------------------------------------------------------------------------------------ zygote side
def serve(socket_path: str, parent_pid: int) -> None:
    """Import vLLM, listen on ``socket_path``, fork a server per request; exit when ``parent_pid`` is gone. One
    thread only (a fork copies the calling thread alone)."""
    import importlib

    from megatron_rl.inference.engine_process import vllm_serve

    before = dict(os.environ)
    vllm_serve._vllm_cpu_version()  # W29, before vLLM's import reads the version
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # as ``vllm_serve.main`` sets it, before the imports
    for name in _IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # what the imports set in the environment (torch and vLLM do: TORCHINDUCTOR_*, LD_LIBRARY_PATH, ...) a plain
    # start would have set too: each server gets it on top of its own environment
    imported_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    hello = json.dumps({"python": sys.executable, "env": import_time_env(before),
                        "set_by_imports": import_time_env(imported_env)}).encode() + b"\n"
    partial = f"{socket_path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(partial)
    listener.listen(64)
    os.replace(partial, socket_path)  # appears only once the zygote serves
    children: dict[int, socket.socket | None] = {}  # server pid -> its connection (lifeline; None once closed)
    print(f"zygote: serving on {socket_path} (pid {os.getpid()})", flush=True)
    try:
        while _alive(parent_pid):
            ready, _, _ = select.select([listener, *(s for s in children.values() if s)], [], [], 0.5)
            for sock in ready:
                if sock is listener:
                    connection, _ = listener.accept()
                    pid = _fork_server(connection, hello, imported_env, listener, children)
                    if pid:
                        children[pid] = connection
                        print(f"zygote: forked server {pid}", flush=True)
                else:  # a lifeline closed (the trainer sends nothing on it): the trainer is gone
                    pid = next(p for p, s in children.items() if s is sock)
                    _killpg(pid)
                    sock.close()
                    children[pid] = None
            _reap(children)
    finally:
        for pid in list(children):
            _killpg(pid)
        try:
            os.unlink(socket_path)
        except OSError:
            pass


def _fork_server(connection: socket.socket, hello: bytes, imported_env: dict[str, str], listener: socket.socket,
                 children: dict[int, socket.socket | None]) -> int | None:
    connection.settimeout(30)
    try:
        connection.sendall(hello)
        data, fds = b"", []
        while not data.endswith(b"\n"):
            chunk, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
            if not chunk:
                raise ConnectionError("closed before its request")
            data += chunk
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        request = json.loads(data.decode())
        if len(fds) != 1:
            raise ValueError(f"expected one log file descriptor, got {len(fds)}")
    except (OSError, ValueError) as err:
        try:
            connection.sendall(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode() + b"\n")
        except OSError:
            pass
        connection.close()
        return None
    pid = os.fork()
    if pid == 0:  # the server
        code = 1
        try:
            listener.close()
            connection.close()
            for sock in children.values():
                if sock is not None:
                    sock.close()
            _become_server(request, imported_env, fds[0])
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - the traceback goes to the server's log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(fds[0])
    try:
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the trainer is gone already: its lifeline reads closed next, which kills the server
        pass
    connection.settimeout(None)
    return pid


def _become_server(request: dict[str, Any], imported_env: dict[str, str], log_fd: int) -> None:
    """In the forked child: what ``Popen(..., start_new_session=True, cwd=..., env=..., stdout=log)`` gives, then
    ``vllm_serve.main``."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    argv = list(request["argv"])
    title = " ".join([sys.executable, "-m", "megatron_rl.inference.engine_process.vllm_serve", *argv])
    try:
        import setproctitle  # a vLLM dependency: ``ps`` shows the plain start's command line

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(imported_env)
    sys.argv = [title]
    import random

    random.seed()  # not the zygote's (shared by every fork) state
    from megatron_rl.inference.engine_process import vllm_serve

    vllm_serve.main(argv)


def _reap(children: dict[int, socket.socket | None]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            connection.close()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_rl.inference.engine_process.zygote",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on (appears once ready)")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit (killing the servers) when it is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the servers it holds are killed on the way out
    serve(args.socket, args.parent_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
