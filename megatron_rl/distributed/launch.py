"""torchrun for megatron_rl jobs, with one-line errors: a mistake the ranks find is one line, not torchrun's dump.

Place in the data flow: the launcher (``run_megatron.sh`` runs ``python -m megatron_rl.distributed.launch
<torchrun arguments>``); the ranks call ``report_error`` where they stop for a reason that is the user's or the
storage's (a config value, a checkpoint of another run, a full disk), the same on every rank.

Why: torchrun answers any child that exits non-zero with a warning per surviving rank, an error line and a
30-45-line ``ChildFailedError`` table, which buries the one line that says what to fix. Here every rank that
stops for a reported reason writes its line and exit code to a file in ``$MEGATRON_RL_ERROR_DIR`` (a temporary
directory this launcher creates) before it exits; when the job fails and such a file exists, the launcher drops
torchrun's failure log lines, prints the line once and exits with its code. A child that crashed without a
report (a bug) gets torchrun's usual report, and the child's own traceback is printed by the child as always.
Without the launcher (plain ``torchrun`` or ``python``), ``report_error`` prints the line on rank 0 instead.

torchrun's own per-rank folders (``--log-dir``; without one torchrun makes ``<tmp>/torchelastic_*`` and never
removes it, one folder left in /tmp per launch) go to that temporary directory too, removed when the launcher
exits; a ``--log-dir`` of the user's still wins (the last one given counts).

SIGUSR1 and SIGTERM (a scheduler's preemption warning) are the launcher's, not torchrun's: the ranks save a
checkpoint at their next step boundary and exit with code 3, the line they report printed once as above
(``distributed/preemption.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

ERROR_DIR_ENV = "MEGATRON_RL_ERROR_DIR"
"""Directory (set by ``main`` for the ranks) where each rank leaves ``rank_<RANK>.txt``: ``<code>\\t<line>``."""


def report_error(message: str, *, code: int) -> int:
    """Report the reason this rank stops (every rank calls it with the same message); returns ``code``.

    Under the launcher the line goes to ``$MEGATRON_RL_ERROR_DIR`` (printed once by the launcher); otherwise rank
    0 prints it to stderr. No traceback: the message names the key, file or directory and the fix.
    """
    directory = os.environ.get(ERROR_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if directory and Path(directory).is_dir():
        path = Path(directory) / f"rank_{rank}.txt"
        tmp = path.with_suffix(".tmp")  # renamed into place: the launcher never reads half a line
        tmp.write_text(f"{code}\t{message}\n")
        tmp.replace(path)
    elif rank == "0":
        print(message, file=sys.stderr, flush=True)
    return code


def reported_error(directory: Path) -> tuple[int, str] | None:
    """``(code, line)`` of the lowest rank that reported, or None when no rank did."""
    reports = sorted(directory.glob("rank_*.txt"), key=lambda p: int(p.stem.removeprefix("rank_")))
    for path in reports:
        code, _, line = path.read_text().rstrip("\n").partition("\t")
        return int(code), line
    return None


class _DropFailureLogs(logging.Filter):
    """Drops torchrun's per-child failure lines ("failed (exitcode: 2) ...", "Sending process ... closing signal
    SIGTERM") once a rank has reported why it stops; a crash without a report keeps them."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        return reported_error(self.directory) is None


class _DropSignalLogs(logging.Filter):
    """Drops torchrun's "Received SIGINT death signal, shutting down workers" and "Sending process ... closing
    signal SIGINT" lines: Ctrl-C is the user's own doing, and the job says what it kept (``job/main.py``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "death signal" not in message and "closing signal SIGINT" not in message


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_rl.distributed.launch <torchrun arguments>``: torchrun's exit code, or the reported
    one (module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    from megatron_rl.distributed.preemption import torchrun_arguments, watch_launcher

    with tempfile.TemporaryDirectory(prefix="megatron_rl-errors-") as tmp:
        directory = Path(tmp)
        os.environ[ERROR_DIR_ENV] = tmp  # the ranks inherit the launcher's environment
        failure_logs = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        failure_logs.addFilter(_DropFailureLogs(directory))
        failure_logs.addFilter(_DropSignalLogs())
        logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_DropSignalLogs())
        watch_launcher(directory)  # SIGUSR1/SIGTERM: the ranks save and stop at their next step boundary

        @record  # torchrun's own report for a child that failed without saying why
        def launch() -> int:
            try:
                args = list(sys.argv[1:] if argv is None else argv)
                run(parse_args(["--log-dir", str(directory / "torchelastic"), *torchrun_arguments(), *args]))
            except ChildFailedError:
                reported = reported_error(directory)
                if reported is None:
                    raise
                code, line = reported
                print(line, file=sys.stderr, flush=True)
                return code
            except SignalException as err:  # Ctrl-C (or a SIGTERM): the ranks were told; no traceback
                reported = reported_error(directory)
                if reported is not None:
                    print(reported[1], file=sys.stderr, flush=True)
                return 128 + int(err.sigval)
            return 0

        return launch() or 0


if __name__ == "__main__":
    sys.exit(main())
