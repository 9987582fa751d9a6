"""A kill while resuming rewrites metrics.jsonl loses no row: the old file survives bitwise, and the resume
that follows ends with every row of the uninterrupted run (job/reporting.py, megatron_rl/atomic.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.job.reporting import RunReporter, WallTimes

ROWS = 6


def _log(reporter: RunReporter, steps: range) -> None:
    for step in steps:
        reporter.log_step(step, {"reward/mean": step / 10, "policy/loss": -step / 3})


def _reporter(out: Path, start_step: int) -> RunReporter:
    return RunReporter(out, total_steps=ROWS, start_step=start_step, tensorboard=False, progress_bar=False,
                       log_interval=100)


def test_sigkill_between_write_and_rename_keeps_every_row(tmp_path):
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    _log(_reporter(reference, 0), range(1, ROWS + 1))
    _log(_reporter(crashed, 0), range(1, 5))  # steps 1-4 logged, the checkpoint is at step 3, step 4 is a tail
    with (crashed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')  # and a torn line of a killed step 5
    before = (crashed / "metrics.jsonl").read_bytes()
    # Resume from step 3, SIGKILLed after the new content is written and fsynced, before the rename.
    script = textwrap.dedent(f"""
        import os, signal
        import megatron_rl.atomic as atomic
        atomic.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        from pathlib import Path
        from megatron_rl.job.reporting import RunReporter
        RunReporter(Path({str(crashed)!r}), total_steps={ROWS}, start_step=3, tensorboard=False, progress_bar=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert (crashed / "metrics.jsonl").read_bytes() == before  # the old version, bitwise
    _log(_reporter(crashed, 3), range(4, ROWS + 1))  # the resume that follows
    assert (crashed / "metrics.jsonl").read_text().splitlines()[:3] == before.decode().splitlines()[:3]
    ref_rows = [r.split('"time_s"')[0] for r in (reference / "metrics.jsonl").read_text().splitlines()]
    got_rows = [r.split('"time_s"')[0] for r in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert got_rows == ref_rows


def test_summary_and_plot_are_replaced_atomically(tmp_path, monkeypatch):
    import megatron_rl.atomic as atomic

    reporter = _reporter(tmp_path, 0)
    _log(reporter, range(1, ROWS + 1))
    reporter.finish(baseline=0.1, times=WallTimes(1.0, 1.0, 2.0))
    summary, plot = (tmp_path / "summary.txt").read_bytes(), (tmp_path / "reward_loss.png").read_bytes()

    def fail(src, dst):
        raise OSError("injected failure at the rename")

    again = _reporter(tmp_path, ROWS)
    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="injected"):
        again.finish(baseline=0.2, times=WallTimes(1.0, 2.0, 3.0))
    assert (tmp_path / "summary.txt").read_bytes() == summary and (tmp_path / "reward_loss.png").read_bytes() == plot
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]  # no temporary file left
