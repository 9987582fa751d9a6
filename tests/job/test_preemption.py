"""Preemption (``megatron_rl/distributed/preemption.py``): SIGUSR1/SIGTERM to a launcher -> the ranks agree on a step
boundary, save there and exit with code 3 -> the command the line prints resumes, bitwise.

Cost: the unit tests ~2 s (three bare Python processes, no torch); the end-to-end test (``slow``) five launchers of
the CPU demo (two nodes, the same two again, one reference): 156 s and 236 s measured on the 2-core machine while
other jobs ran.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.job_run import ROOT, metric_rows
from tests.support.multirank import free_port
from megatron_rl.distributed import preemption
from megatron_rl.distributed.preemption import Action, boundary_action

FAST = ["demo.baseline_episodes=200", "logging.progress_bar=false", "parallel.device=cpu", "job.num_steps=6",
        "checkpoint.save_interval=0"]
USR1, TERM = int(signal.SIGUSR1), int(signal.SIGTERM)


def test_the_step_boundary_decision() -> None:
    assert boundary_action(0, 3, 6, saved_step=0) is Action.CONTINUE  # no signal anywhere
    assert boundary_action(USR1, 3, 6, saved_step=0) is Action.SAVE_AND_STOP
    assert boundary_action(TERM, 3, 6, saved_step=2) is Action.SAVE_AND_STOP
    assert boundary_action(USR1, 3, 6, saved_step=3) is Action.STOP  # its checkpoint was due: not saved twice
    assert boundary_action(USR1, 6, 6, saved_step=6) is Action.CONTINUE  # the last step: the run ends as usual
    line = preemption.stopped_message(USR1, 3, 6, "/x/checkpoints/step_00000003")
    assert line.startswith("megatron_rl: stopped on SIGUSR1 after step 3 of 6 (checkpoint /x/checkpoints/step_00000003)")


RANK = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("preemption", sys.argv[1])  # alone: no torch import (~5 s)
preemption = importlib.util.module_from_spec(spec)
spec.loader.exec_module(preemption)
preemption.watch_rank()
os.kill(os.getpid(), signal.SIG{sig})
time.sleep(0.1)
print("vote", preemption.local_vote(), flush=True)
"""


def _rank(sig: str, stop_file: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != preemption.STOP_FILE_ENV}
    if stop_file is not None:
        env[preemption.STOP_FILE_ENV] = str(stop_file)
    return subprocess.run([sys.executable, "-c", RANK.format(sig=sig), preemption.__file__], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_rank_stops_on_usr1_and_on_sigterm_only_when_its_launcher_was_signalled(tmp_path: Path) -> None:
    """torchrun's teardown (SIGTERM to a worker after another failed) must still kill a rank at once; a SIGTERM
    that the launcher got too (Slurm signals every process) is a stop request."""
    assert _rank("USR1", None).stdout.split() == ["vote", str(USR1)]
    torn_down = _rank("TERM", None)
    assert torn_down.returncode == -TERM and "vote" not in torn_down.stdout
    stop = tmp_path / "stop"
    stop.write_text("SIGTERM")
    assert _rank("TERM", stop).stdout.split() == ["vote", str(TERM)]


def _node(rank: int, port: int, out: Path) -> subprocess.Popen:
    """One of two simulated nodes (a launcher with one rank), in its own process group as ``srun`` starts it."""
    env = {**os.environ, "PY": sys.executable, "NPROC": "1", "NNODES": "2", "NODE_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("MEGATRON_RL_COMMAND", None)
    return subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), f"logging.output_dir={out}", *FAST], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _communicate(proc: subprocess.Popen, code: int) -> str:
    try:
        text, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"no exit:\n{proc.communicate()[0][-4000:]}") from None
    assert proc.returncode == code, text[-6000:]
    return text


def _left_over(out: Path) -> list[str]:
    """Command lines of live processes that name ``out`` (the launchers and ranks do: their overrides)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(out) in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.slow
@pytest.mark.multirank
def test_a_signalled_node_stops_both_with_a_checkpoint_and_the_printed_command_resumes_bitwise(tmp_path: Path):
    out, ref = tmp_path / "run", tmp_path / "ref"
    port = free_port()
    nodes = [_node(rank, port, out) for rank in (0, 1)]
    rows = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (rows.exists() and len(rows.read_text().splitlines()) >= 2):
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    os.killpg(nodes[1].pid, signal.SIGUSR1)  # node 1's launcher only: node 0 hears of it through the vote
    time.sleep(0.3)
    os.killpg(nodes[1].pid, signal.SIGTERM)  # a second signal (often during the save) changes nothing
    texts = [_communicate(n, preemption.EXIT_CODE) for n in nodes]
    assert "got SIGUSR1: saving a checkpoint" in texts[1] and "got SIG" not in texts[0], texts[0][-3000:]
    stopped = [re.search(r"megatron_rl: stopped on SIG(USR1|TERM) after step (\d) of 6 \(checkpoint (\S+)\); run "
                         r"the same command again to resume: (.*)$", t, re.M) for t in texts]
    assert all(stopped), texts
    step = int(stopped[0][2])
    assert stopped[1][2] == str(step) and 2 <= step < 6  # both nodes stopped after the same step
    assert Path(stopped[0][3]) == out / "checkpoints" / f"step_{step:08d}" and Path(stopped[0][3]).is_dir()
    assert [r["step"] for r in metric_rows(out)] == list(range(1, step + 1))
    assert "Traceback" not in texts[0] + texts[1] and not _left_over(out)

    again = [subprocess.Popen(["bash", "-c", s[4]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for s in stopped]  # the printed command, as printed, on each node
    assert f"resuming after step {step}" in _communicate(again[0], 0)
    _communicate(again[1], 0)
    straight = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), f"logging.output_dir={ref}", *FAST], cwd=ROOT,
                              env={**os.environ, "PY": sys.executable, "NPROC": "2"}, capture_output=True, text=True,
                              timeout=300)
    assert straight.returncode == 0, straight.stdout[-4000:]
    assert metric_rows(out) == metric_rows(ref)  # DP2 either way: the same losses, rewards, samples, bit for bit
    assert not _left_over(out)


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant (what Slurm signals: the step's whole process tree)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) if proc.name.isdigit() else None
        except (OSError, ValueError, IndexError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["megatron_rl.job.start", "megatron_rl.job.main"])
def test_a_warning_while_starting_stops_with_exit_3(phase: str, tmp_path: Path) -> None:
    """SIGUSR1 to every process of the launch (as srun forwards Slurm's warning) while the launcher runs its
    pre-flight (before its own handler), or while the ranks import (before theirs): the run stops before step 1
    with exit code 3 instead of dying of the signal (``megatron_rl/early_signals.py``). ~12 s each (a launch of
    the CPU demo stopped before its first step). Planted: no ``early_signals.install()`` -> killed (-10 / 1)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "run_megatron.sh"), f"logging.output_dir={out}", *FAST], cwd=ROOT,
                            env={**os.environ, "PY": sys.executable, "NPROC": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not any(phase in _cmdline(pid) for pid in _tree(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.05)
    time.sleep(0.3)  # past the interpreter's start (~0.05 s): the rest of the phase is seconds of imports
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    text = _communicate(proc, preemption.EXIT_CODE)
    assert "megatron_rl: stopped on SIGUSR1" in text and "Traceback" not in text, text[-4000:]
    assert not (out / "metrics.jsonl").exists() and not _left_over(out)
