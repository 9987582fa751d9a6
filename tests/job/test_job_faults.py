"""What the main job does when things go wrong around it: Ctrl-C (before the first checkpoint: it says the next
run starts from the beginning; no traceback from a helper process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.multirank import free_port

ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, *overrides: str) -> subprocess.Popen:
    """``bash run_megatron.sh`` (the digit-game demo, built-in engine) in its own process group, as a terminal
    runs it (Ctrl-C = SIGINT to the group)."""
    env = {**os.environ, "PY": sys.executable, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), f"logging.output_dir={out}", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_rows(out: Path, proc: subprocess.Popen, rows: int, timeout: float = 300) -> None:
    path, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"the job did not reach step {rows}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.multirank
def test_ctrl_c_before_the_first_checkpoint_says_the_next_run_starts_over(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "job.num_steps=1000", "checkpoint.save_interval=0")
    _wait_rows(out, proc, 2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: every process of the foreground group
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text
    assert "before the first checkpoint: nothing was saved" in text and "from the beginning" in text, text
    assert "resume from it" not in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
