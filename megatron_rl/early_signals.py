"""A preemption warning (SIGUSR1) that arrives while a launch is still starting is kept, not fatal.

Slurm's ``--signal=B:USR1@<s>`` warning is forwarded by ``srun`` to every process of the step (the tasks' whole
process tree): ``run_megatron.sh``'s shell, the short Python helpers it runs (``job.paths``, ``launch.plan``,
``job.threads``), the launcher before its handler (``distributed/preemption.py: watch_launcher``) and each rank
while it imports, before ``watch_rank``. SIGUSR1's default action kills, so a warning in those seconds (a short
time limit, a resumed job near its limit) would fail the job instead of stopping it with exit code 3 and a
requeue. ``run_megatron.sh`` traps it in its shell, exports ``HOLD_ENV=1`` for every process it starts, and passes
one it got on as ``$MEGATRON_RL_EARLY_STOP`` to the launcher; every ``megatron_rl`` process started with
``HOLD_ENV`` records SIGUSR1 from its first import (``megatron_rl/__init__.py`` calls ``install``) until the
launcher's or the rank's own handler takes over and counts what was recorded (``received``). A library user
(no ``HOLD_ENV``) gets no handler. SIGTERM keeps its default during start-up: at that point it is a preemption or
a ``scancel``, after which Slurm kills anyway, and there is no progress to save.

Stdlib only (imported by the package's ``__init__``).
"""

from __future__ import annotations

import os
import signal

HOLD_ENV = "MEGATRON_RL_HOLD_STOP_SIGNALS"
EARLY_STOP_ENV = "MEGATRON_RL_EARLY_STOP"
"""The stop signal's name (``SIGUSR1``) that ``run_megatron.sh``'s shell got before it started the launcher."""

_received = 0


def install() -> None:
    """Record SIGUSR1 in this process (only under ``run_megatron.sh``: ``HOLD_ENV=1``)."""
    if os.environ.get(HOLD_ENV) == "1" and hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, _record)


def _record(signum: int, _frame: object) -> None:
    global _received
    _received = signum


def recorded() -> int:
    """The stop signal this process itself recorded since its first import (0: none)."""
    return _received


def received() -> int:
    """The stop signal this process, or the shell before it, got while starting (0: none)."""
    if _received:
        return _received
    name = os.environ.get(EARLY_STOP_ENV, "")
    try:
        return int(signal.Signals[name]) if name else 0
    except KeyError:
        return 0
