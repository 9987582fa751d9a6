"""What the main job does when things go wrong around it: Ctrl-C (before the first checkpoint: it says the next
run starts from the beginning; no traceback from a helper process: the checkpoint writer's manager does not even
import the job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multirank import free_port

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


RANK = """
import os, signal, sys, time
if __name__ == "__mp_main__":  # a spawned child that imports the rank's main module (job/main.py: slow)
    open(os.environ["MARK"], "w").close()
elif __name__ == "__main__":
    from megatron_rl.checkpoint.dist import writer_queue_dies_with_rank
    writer_queue_dies_with_rank()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue.put("x")
    assert filesystem_async._results_queue.get() == "x"
    print("the queue works", flush=True)
"""


@pytest.mark.slow
def test_the_checkpoint_writer_queue_starts_without_the_ranks_main_module(tmp_path):
    """W31's manager process, spawned at the first save into the rank's process group, starts without importing
    the rank's main module (``lifetime.bare_main``): nothing of the job runs there, so a Ctrl-C while it starts
    cannot print a KeyboardInterrupt traceback from it (and it starts with SIGINT ignored as well), and it costs
    ~0.5 s and ~20 MB instead of a re-import of the job (~5 s of CPU, ~700 MB)."""
    (tmp_path / "rank_main.py").write_text(RANK)
    mark = tmp_path / "imported"
    done = subprocess.run([sys.executable, "-m", "rank_main"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "MARK": str(mark)}, timeout=120)
    assert done.returncode == 0 and "the queue works" in done.stdout, done.stdout + done.stderr
    assert not mark.exists(), "the manager imported the rank's main module"
    assert "Traceback" not in done.stderr, done.stderr
