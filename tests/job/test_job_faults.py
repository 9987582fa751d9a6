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
if __name__ == "__mp_main__":  # the manager, spawned: it re-imports the rank's main module (job/main.py: slow)
    open(os.environ["MARK"], "w").close()
    time.sleep(3)
elif __name__ == "__main__":
    from megatron_rl.checkpoint.dist import writer_queue_dies_with_rank
    writer_queue_dies_with_rank()
    print("the queue works:", writer_queue_dies_with_rank.__module__, flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_the_checkpoint_writer_queue_starts_is_the_ranks(tmp_path):
    """W31's manager process, spawned at the first save into the rank's process group, re-imports the rank's main
    module; a Ctrl-C then must not print its KeyboardInterrupt traceback (it starts with SIGINT ignored)."""
    (tmp_path / "rank_main.py").write_text(RANK)
    mark = tmp_path / "importing"
    rank = subprocess.Popen([sys.executable, "-m", "rank_main"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "MARK": str(mark)})
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert rank.poll() is None and time.monotonic() < deadline, rank.communicate()
        time.sleep(0.05)
    os.killpg(rank.pid, signal.SIGINT)  # Ctrl-C: the whole group, the manager importing
    out, err = rank.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "the queue works" in out, out + err
