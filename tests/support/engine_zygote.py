"""The test session's engine zygote (megatron_rl/inference/engine_process/zygote.py): started once when engine tests are
collected; every CPU engine a test's job starts is forked from it (~6 s instead of ~17 s on the 2-core machine),
through ``$MEGATRON_RL_ENGINE_ZYGOTE``, which the jobs the tests launch inherit.

``MEGATRON_RL_TEST_ZYGOTE=0`` starts every engine the usual way (``python -m megatron_rl.inference.engine_process.vllm_serve``).
A test that must prove the plain start unsets ``$MEGATRON_RL_ENGINE_ZYGOTE`` for its job
(``tests/inference/test_zygote.py`` compares the two).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from tests.support.engine_env import REPO

_started: dict = {}


def start(items) -> None:
    """Start the zygote in the background (it imports vLLM while the first tests run) if an engine test runs."""
    if os.environ.get("MEGATRON_RL_TEST_ZYGOTE", "1") == "0" or not any("engine" in i.keywords for i in items):
        return
    python = os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(REPO / ".venv-engine" / "bin" / "python")
    if not Path(python).is_file():
        return  # the engine tests skip (or fail, naming the set-up command)
    from megatron_rl.inference.engine_process import zygote
    from megatron_rl.inference.vllm.server import start_zygote

    folder = Path(tempfile.mkdtemp(prefix="mrl-zygote-"))  # short: a Unix socket's path has ~100 bytes at most
    socket_path = folder / "engines.sock"
    _started.update(proc=start_zygote(python, socket_path, folder / "zygote.log"), folder=folder)
    os.environ[zygote.ZYGOTE_ENV] = str(socket_path)


def stop() -> None:
    proc = _started.pop("proc", None)
    if proc is None:
        return
    from megatron_rl.inference.engine_process import zygote

    os.environ.pop(zygote.ZYGOTE_ENV, None)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # it kills the servers it still holds, then exits
        proc.wait(timeout=10)
    except (ProcessLookupError, OSError):
        pass
    except Exception:  # noqa: BLE001 - still running after 10 s
        os.killpg(proc.pid, signal.SIGKILL)
    folder = _started.pop("folder")
    try:
        forked = (folder / "zygote.log").read_text(errors="replace").count("zygote: forked server")
        print(f"\nengine zygote (tests/support/engine_zygote.py): {forked} engine servers forked", file=sys.stderr)
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
