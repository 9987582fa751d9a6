"""The ranks start while the pre-flight runs, and wait here for its verdict before doing anything of the run.

Place in the data flow: ``job/start.py`` (the launcher) runs the pre-flight in a thread while torchrun starts the
ranks, then writes its verdict to the file ``$MEGATRON_RL_PREFLIGHT_GATE`` names (``open_gate``); ``job/main.py``
calls ``wait`` first in ``main``: after the module imports that take a rank's first seconds (torch), before it
reads the config, prints a line or touches a file. Verdict 0: the run goes on. Anything else: the rank returns 0
at once and says nothing (the launcher has printed the pre-flight's line and exits with its code), so a refused
run still makes nothing of its own. Why: the pre-flight (~2 s: the checkpoint's config read through transformers,
the data and reward checks) and a rank's torch import (~2 s) ran one after the other (issue 53, start-up).

The verdict also carries the environment variables the launcher set while the pre-flight ran (the ranks would
have inherited them when they started after it): the engine zygote's socket, for one.
Without the variable (plain torchrun, Ray's actors, a library user) ``wait`` returns at once. A rank whose
launcher is gone (its parent changed) stops waiting with code 1; Ctrl-C while waiting is code 130, no traceback.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

GATE_ENV = "MEGATRON_RL_PREFLIGHT_GATE"
POLL_S = 0.02


def open_gate(path: str | Path, code: int, env: dict[str, str] | None = None) -> None:
    """The launcher's verdict: the pre-flight's exit code (0: go) and the environment variables the launcher set
    while it ran (the ranks started before: e.g. the engine zygote's socket, ``inference/vllm/job_zygote.py``),
    written whole (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"code": code, "env": env or {}}))
    tmp.replace(path)


def wait() -> int | None:
    """None: go on with the run (the launcher's variables set in ``os.environ``). A number: return it from
    ``main`` now (0: the pre-flight refused the run)."""
    path = os.environ.get(GATE_ENV)
    if not path:
        return None
    parent = os.getppid()
    try:
        while True:
            try:
                verdict = json.loads(Path(path).read_text())
            except FileNotFoundError:
                if os.getppid() != parent:
                    return 1
                time.sleep(POLL_S)
                continue
            if verdict["code"]:
                return 0
            os.environ.update(verdict["env"])
            return None
    except KeyboardInterrupt:
        return 130
