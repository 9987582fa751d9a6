"""The job's own engine zygote: vLLM imported once, while the trainer's ranks start, and the job's CPU engines
forked from it (``inference/engine_process/zygote.py``).

Why: a CPU ``vllm serve`` start is ~17 s on the 2-core machine, ~11 of them importing vLLM; the first engine start
comes after the ranks' imports, process groups and model build (~8-10 s). A zygote started by the launcher
imports vLLM during those seconds, and the engine forked from it serves ~6 s after its start: the vLLM demo's
start-up drops by about the import (BENCHMARKS.md section 12).

Place in the data flow: ``job/start.py`` (the launcher, after the pre-flight) calls ``start_for`` with the job's
config; when it returns a zygote, ``$MEGATRON_RL_ENGINE_ZYGOTE`` names its socket for the ranks it starts, where
``EngineServer.start`` (``server.py``) forks every CPU engine from it (or starts one the usual way, with a line on
stderr, when the zygote cannot serve it). ``stop`` ends it after torchrun; it also exits by itself when the
launcher is gone.

Used only where it pays and is safe: ``rollout.engine=vllm`` with engines this node starts (no ``engine_urls``
only, no ``rollout.engine_nodes``, this node among the first ``num_engines``), CPU engines (no visible GPU: a forked
CUDA context is unusable), no zygote given already (the test suite's), ``MEGATRON_RL_ENGINE_ZYGOTE=off`` not set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.inference.engine_process.zygote import ZYGOTE_ENV


@dataclass
class JobZygote:
    proc: subprocess.Popen
    folder: Path

    def stop(self) -> None:
        """Kill the zygote's session (its forked servers are the ranks' to end; they are gone by now) and remove
        its socket folder."""
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def wanted(job_config: Any, env: dict[str, str] | None = None) -> str | None:
    """Why no zygote is started for this node (a phrase), or None when one is."""
    env = os.environ if env is None else env
    rollout = job_config.rollout
    if rollout.engine != "vllm" or rollout.num_engines == 0:
        return "no engine of the job's own"
    if env.get(ZYGOTE_ENV):
        return f"${ZYGOTE_ENV} is set (to a zygote, or 'off')"
    if rollout.engine_nodes:
        return "the engines run on nodes of their own (rollout.engine_nodes)"
    if int(env.get("NODE_RANK", "0") or 0) >= rollout.num_engines:
        return "this node starts no engine"
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "GPU engines start the usual way"
    return None


def start_for(job_config: Any) -> JobZygote | None:
    """A zygote for this node's CPU engines, its socket in ``$MEGATRON_RL_ENGINE_ZYGOTE`` (inherited by the ranks),
    or None (``wanted``). A missing engine interpreter is left to the engine's own start (one line there)."""
    if wanted(job_config) is not None:
        return None
    from megatron_rl.inference.vllm.launcher import engine_python
    from megatron_rl.inference.vllm.server import start_zygote

    try:
        python = engine_python(job_config.rollout)
    except ValueError:
        return None
    folder = Path(tempfile.mkdtemp(prefix="megatron_rl_zygote_"))  # short: a Unix socket path has ~107 bytes
    socket_path = folder / "zygote.sock"
    log_dir = Path(job_config.rl.logging.output_dir) / "engine"
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = start_zygote(python, socket_path, log_dir / "zygote.log")
    os.environ[ZYGOTE_ENV] = str(socket_path)
    return JobZygote(proc=proc, folder=folder)
