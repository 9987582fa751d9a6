"""One trainer rank under Ray: an actor that owns the rank's process (``python -m megatron_rl.job.main``).

Place in the data flow: ``launch/ray_driver.py`` wraps ``RankProcess`` with ``ray.remote`` and starts one actor per
rank (named ``megatron_rl-rank<N>``) in its node's placement-group bundle. The actor

    place()      says where it runs: Ray node id, address, host name, the GPUs Ray gave it
    free_port()  a free TCP port on its node (rank 0's: the rendezvous port)
    start(...)   starts the rank with the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
                 LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT: set by the driver), its stdout and stderr copied
                 into ``<logging.output_dir>/ray_logs/rank_<N>.log`` and kept for the driver to print
    poll()       the output since the last call, the exit code once it ended, and the line the rank reported
                 (``distributed/launch.py: report_error``: a config or checkpoint mistake, an interrupted run)
    signal(sig)  passes a signal on (Ctrl-C of the driver: SIGINT, as the terminal gives it under torchrun)
    stop(grace)  SIGTERM, then SIGKILL after ``grace`` seconds

The rank is the actor's child with ``PR_SET_PDEATHSIG`` (``lifetime.die_with_parent``): when the actor's process
ends for any reason (``ray.kill``, the driver gone, the node's raylet gone) the kernel kills the rank too. The rank
is started from the actor's main thread (a sync actor runs its methods there; the death signal follows the thread
that forked). Plain class, no Ray import at module level: the actor's methods import ``ray`` where they need it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from megatron_rl.distributed.launch import ERROR_DIR_ENV, reported_error
from megatron_rl.lifetime import die_with_parent

CHUNK = 65536


def _child_setup() -> None:
    """In the rank, before it runs: die with the actor; SIGINT and SIGTERM back to their defaults (a Ray worker
    ignores SIGINT, and an ignored signal stays ignored across exec: Python would then never raise
    KeyboardInterrupt on the driver's Ctrl-C)."""
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


class RankProcess:
    """The actor of one trainer rank (module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.chunks: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.pumps: list[threading.Thread] = []
        self.error_dir: str | None = None
        self.reported: tuple[int, str] | None = None

    def place(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, args: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        """Start ``<this node's Python> <args>`` (once: the actor's interpreter, the venv of the node's Ray); its
        pid."""
        assert self.proc is None, "the rank was started already"
        self.error_dir = tempfile.mkdtemp(prefix=f"megatron_rl-errors-rank{self.rank}-")
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, *args], env={**env, ERROR_DIR_ENV: self.error_dir}, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     preexec_fn=_child_setup)
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            pump = threading.Thread(target=self._pump, args=(name, pipe, log_file), daemon=True)
            pump.start()
            self.pumps.append(pump)
        threading.Thread(target=self._close_when_done, args=(log_file,), daemon=True).start()
        return self.proc.pid

    def _pump(self, name: str, pipe: Any, log_file: Any) -> None:
        """Copy one of the rank's streams into its log and the driver's queue, as it comes (a progress bar's
        carriage returns included)."""
        fd = pipe.fileno()
        while data := os.read(fd, CHUNK):
            with self.lock:
                log_file.write(data)
                log_file.flush()
                self.chunks.append((name, data))

    def _close_when_done(self, log_file: Any) -> None:
        for pump in self.pumps:
            pump.join()
        with self.lock:
            log_file.close()

    def poll(self) -> tuple[list[tuple[str, bytes]], int | None, tuple[int, str] | None]:
        """``(output chunks since the last call, exit code or None while running, reported (code, line))``;
        the exit code only once all of the rank's output was read."""
        assert self.proc is not None, "poll() before start()"
        code = self.proc.poll()
        if code is not None:
            for pump in self.pumps:
                pump.join(timeout=5)
        with self.lock:
            chunks, self.chunks = self.chunks, []
        if code is None:
            return chunks, None, None
        return chunks, code, self._reported()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, grace: float) -> int | None:
        """End the rank: SIGTERM, SIGKILL after ``grace`` s; its exit code (None: it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reported()  # its temporary folder removed
        return self.proc.returncode

    def _reported(self) -> tuple[int, str] | None:
        """The rank's reported line (read once; its temporary folder is removed then)."""
        if self.error_dir is not None:
            self.reported = reported_error(Path(self.error_dir))
            shutil.rmtree(self.error_dir, ignore_errors=True)
            self.error_dir = None
        return self.reported
