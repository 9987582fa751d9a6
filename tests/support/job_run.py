"""The main job as a user runs it (``bash run_megatron.sh <overrides>``) and the metrics it writes: shared by the
end-to-end tests of ``tests/job``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.support.multirank import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_megatron(*overrides: str, config: str | Path | None = None, cwd: Path = ROOT, code: int = 0
                 ) -> subprocess.CompletedProcess:
    """``bash run_megatron.sh <overrides>`` in ``cwd`` on a free port (``CONFIG=<config>`` when given; ``""``: the
    base config the script picks itself); asserts it exits with ``code``."""
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port())}
    if config is not None:
        env["CONFIG"] = str(config)
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, failure_text(proc)
    return proc


ENGINE_LOG_LINE = re.compile(r"^\((APIServer|EngineCore)|^INFO:|^WARNING:|^\s*$")


def failure_text(proc: subprocess.CompletedProcess, chars: int = 3000) -> str:
    """What a failed run printed, for an assertion message: the tail of stdout and of stderr without the engine
    log lines an engine error quotes (they would push the job's own error line out of the tail)."""
    own = "\n".join(line for line in (proc.stderr or "").splitlines() if not ENGINE_LOG_LINE.match(line))
    return f"{(proc.stdout or '')[-chars:]}\n--- stderr (engine log lines left out) ---\n{own[-chars:]}"


def metric_rows(out_dir: Path) -> list[dict]:
    """``metrics.jsonl`` of a run without its wall-clock keys (``timing/*``, ``time_s``): what a resumed run must
    reproduce exactly."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k != "time_s"} for r in rows]


def untimed_metrics(out_dir: Path) -> list[dict]:
    """Per-step metrics without any timing key (``time/``, ``perf/``, ``throughput/``, ``timing/``: they differ run to
    run): what the same run under another launcher must reproduce."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "throughput/", "timing/"))}
            for row in rows]


def example_module(path: str) -> ModuleType:
    """A script of ``examples/`` (e.g. ``examples/digit_game/make_model.py``) imported as a module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
