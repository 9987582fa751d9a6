"""The launcher (``megatron_rl/distributed/launch.py``): an error the ranks report is one line and its exit code,
without torchrun's failure report; a rank that crashes without a report keeps torchrun's report."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from multirank import free_port

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import sys
    from megatron_rl.distributed.launch import report_error
    if sys.argv[1] == "report":  # every rank stops for the same reason, as a ConfigError in the main job
        sys.exit(report_error("megatron_rl: config error: x=1 is bad; set x=2", code=2))
    sys.exit(3)  # a crash: no report
""")


def _launch(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.distributed.launch", "--nproc-per-node", "2", "--master-port",
         str(free_port()), str(script), mode],
        capture_output=True, text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                           "PYTHONPATH": str(Path(__file__).parents[2])},
    )


def test_a_reported_error_is_one_line_and_its_exit_code(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "report")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "No CUDA runtime is found" not in line]
    assert lines == ["megatron_rl: config error: x=1 is bad; set x=2"]


def test_a_crash_keeps_torchruns_report(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "crash")
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and "exitcode  : 3" in proc.stderr, proc.stderr
