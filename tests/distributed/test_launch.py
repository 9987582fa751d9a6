"""The launcher (``megatron_rl/distributed/launch.py``): an error the ranks report is one line and its exit code,
without torchrun's failure report; a rank that crashes without a report keeps torchrun's report."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.multirank import free_port

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import sys
    from megatron_rl.distributed.launch import report_error
    if sys.argv[1] == "report":  # every rank stops for the same reason, as a ConfigError in the main job
        sys.exit(report_error("megatron_rl: config error: x=1 is bad; set x=2", code=2))
    if sys.argv[1] == "wait":  # Ctrl-C as the main job handles it (job/main.py: run)
        import os, signal, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        open(sys.argv[2] + "/ready_" + os.environ["RANK"], "w").close()
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            sys.exit(report_error("megatron_rl: interrupted during step 3; the last complete checkpoint is kept", code=130))
    sys.exit(3)  # a crash: no report
""")


ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])}


def _command(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, "-m", "megatron_rl.distributed.launch", "--nproc-per-node", "2", "--master-port",
            str(free_port()), str(script), mode, str(tmp_path)]


def _launch(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(tmp_path, mode), capture_output=True, text=True, timeout=120, env=ENV)


def test_a_reported_error_is_one_line_and_its_exit_code(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "report")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "No CUDA runtime is found" not in line]
    assert lines == ["megatron_rl: config error: x=1 is bad; set x=2"]


def test_a_crash_keeps_torchruns_report(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "crash")
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and "exitcode  : 3" in proc.stderr, proc.stderr


def test_ctrl_c_is_one_line_without_torchruns_traceback(tmp_path: Path) -> None:
    import os
    import signal
    import time

    proc = subprocess.Popen(_command(tmp_path, "wait"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready_*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, _ = proc.communicate(timeout=60)
    lines = [line for line in out.splitlines() if "No CUDA runtime is found" not in line]
    assert proc.returncode == 130, out
    assert lines == ["megatron_rl: interrupted during step 3; the last complete checkpoint is kept"], out


def test_a_taken_master_port_is_one_line(tmp_path: Path) -> None:
    import os
    import socket

    root = Path(__file__).parents[2]
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(["bash", str(root / "run_megatron.sh")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PY": sys.executable, "MASTER_PORT": str(port)}, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1:] == [
        f"run_megatron.sh: MASTER_PORT={port} is in use by another process; unset MASTER_PORT (a single-node run "
        "picks a free port) or choose another"]
    assert "Traceback" not in proc.stderr and "EADDRINUSE" not in proc.stderr
