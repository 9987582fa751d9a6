"""Preemption: SIGUSR1 or SIGTERM to the launcher -> a checkpoint at the next step boundary -> exit code 3.

Place in the data flow: the launcher (``distributed/launch.py``) calls ``watch_launcher``; every rank calls
``watch_rank`` at start and ``stop_vote`` at each step boundary (``job/main.py``), and ``boundary_action`` says
what the loop does there. docs/PREEMPTION_AND_PLACEMENT.md describes it for users.

How a signal reaches the ranks. torchrun starts each worker in a session of its own (``start_new_session``), so a
signal to the launcher or its process group (a terminal, ``kill -USR1 -<pgid>``, Slurm's ``--signal=B:USR1@<s>``
forwarded to each node's launcher) reaches the launcher only. torchrun itself would answer a SIGTERM by sending
SIGTERM to its workers and a SIGKILL 30 s later (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), and a SIGUSR1 would kill the
launcher outright (default action; torchrun does not handle it) and orphan the workers. So the launcher takes
both signals off torchrun (``--signals-to-handle`` without SIGTERM; SIGINT, Ctrl-C, stays torchrun's) and only
writes a file in its per-node temporary folder (``$MEGATRON_RL_STOP_FILE``, inherited by its ranks). A rank
votes to stop when that file exists or it got SIGUSR1/SIGTERM itself (Slurm signals every process of a step at
its time limit); the votes are reduced (max) over all ranks at every step boundary, so all ranks agree on the
step even when one node alone was signalled. The vote is the signal's number, so every rank names the same one.

A rank's SIGTERM handler keeps torchrun's own teardown intact: torchrun sends SIGTERM to the surviving workers
when one failed, and such a worker must still die at once. A SIGTERM is a stop request only when this node's
launcher asked for a stop too (its file appears within ``LAUNCHER_GRACE_S``); otherwise the handler restores the
default action and the rank dies of the signal as before.

A second signal changes nothing (the file is rewritten, the vote was already 1); a SIGKILL during the save keeps
the previous complete checkpoint (saves are atomic: ``checkpoint/layout.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from enum import Enum
from pathlib import Path

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STOP_FILE_ENV = "MEGATRON_RL_STOP_FILE"
"""Set by ``watch_launcher`` for the ranks: ``<the launcher's temporary folder>/stop``, which holds the signal's
name once the launcher got one."""
EXIT_CODE = 3
"""The job stopped on a preemption signal after saving a checkpoint (docs/JOB.md, exit codes)."""
COMMAND_ENV = "MEGATRON_RL_COMMAND"
"""The command line that started the job, as ``run_megatron.sh`` was given it (a scheduler's script may set its
own, e.g. how to resubmit); quoted in the stop line."""
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
"""What torchrun still handles (its default also has SIGTERM, which the launcher takes: module docstring)."""
LAUNCHER_GRACE_S = 1.0
"""How long a rank's SIGTERM handler waits for its launcher's stop file before it treats the SIGTERM as
torchrun's teardown (Slurm signals the launcher and the ranks at the same moment)."""

_received = 0
"""The stop signal this rank got itself (0: none)."""


class Action(Enum):
    """What the RL loop does at the end of a step (``boundary_action``)."""

    CONTINUE = "continue"
    SAVE_AND_STOP = "save and stop"
    STOP = "stop"
    """The checkpoint of this step exists already (it was due): stop without saving again."""


def boundary_action(vote: int, step: int, num_steps: int, saved_step: int) -> Action:
    """The decision at the end of ``step`` (pure; ``vote``: the max over all ranks of ``stop_vote``, so the same
    on every rank). The last step ends the run as usual (its checkpoint is always saved)."""
    if not vote or step >= num_steps:
        return Action.CONTINUE
    return Action.STOP if saved_step == step else Action.SAVE_AND_STOP


def stopped_message(vote: int, step: int, num_steps: int, checkpoint: str | None) -> str:
    """The one line of a stop (exit code ``EXIT_CODE``): how far the run got, its checkpoint and the command
    that continues it (``$MEGATRON_RL_COMMAND``, set by ``run_megatron.sh``)."""
    command = os.environ.get(COMMAND_ENV)
    again = f"run the same command again to resume: {command}" if command else "run the same command again to resume"
    kept = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet (the next run starts from the beginning)"
    return (f"megatron_rl: stopped on {signal.Signals(vote).name} after step {step} of {num_steps} ({kept}); "
            f"{again}")


# --- the launcher ---------------------------------------------------------------------------------------------

def watch_launcher(directory: Path) -> None:
    """In the launcher, before torchrun starts: SIGUSR1/SIGTERM write ``directory/stop`` (atomically) and print
    one line; the ranks (told the path in ``$MEGATRON_RL_STOP_FILE``) stop at their next step boundary."""
    path = directory / "stop"
    os.environ[STOP_FILE_ENV] = str(path)

    def on_signal(signum: int, _frame: object) -> None:
        again = path.exists()
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(signal.Signals(signum).name)
            tmp.replace(path)
        except OSError:  # torchrun has returned and the folder is gone: nothing left to stop
            return
        line = (f"megatron_rl: got {signal.Signals(signum).name} again: still stopping after the current step "
                "(a kill now keeps the last complete checkpoint)" if again else
                f"megatron_rl: got {signal.Signals(signum).name}: saving a checkpoint at the end of the current "
                f"step, then stopping (exit code {EXIT_CODE})")
        os.write(sys.stderr.fileno(), (line + "\n").encode())  # a handler: no buffered print

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    from megatron_rl import early_signals

    if early := early_signals.received():  # got while this node was starting (early_signals.py): stop now
        on_signal(early, None)


def torchrun_arguments() -> list[str]:
    """Put before the user's torchrun arguments (a ``--signals-to-handle`` of theirs still wins)."""
    return ["--signals-to-handle", TORCHRUN_SIGNALS]


# --- the ranks ------------------------------------------------------------------------------------------------

def launcher_stop_signal() -> int:
    """The signal this node's launcher was asked to stop with (0: none)."""
    path = os.environ.get(STOP_FILE_ENV)
    try:
        return int(signal.Signals[Path(path).read_text().strip()]) if path else 0
    except (OSError, KeyError):
        return 0


def watch_rank() -> None:
    """In every rank, on the main thread at start: SIGUSR1 (never sent by torchrun) is a stop request; SIGTERM
    is one only when the launcher asked for a stop too, else the rank dies of it as before (module docstring)."""
    global _received
    from megatron_rl import early_signals

    _received = early_signals.recorded()  # got while this rank imported (early_signals.py); the launcher's: its file

    def on_usr1(signum: int, _frame: object) -> None:
        global _received
        _received = signum

    def on_term(signum: int, _frame: object) -> None:
        global _received
        deadline = time.monotonic() + LAUNCHER_GRACE_S
        while not launcher_stop_signal() and time.monotonic() < deadline:
            time.sleep(0.05)
        if launcher_stop_signal():
            _received = signum
            return
        signal.signal(signum, signal.SIG_DFL)  # torchrun's teardown: die of it, as without this handler
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)


def local_vote() -> int:
    """This rank's vote: the stop signal it or its launcher got (0: none)."""
    return _received or launcher_stop_signal()


def stop_vote(device: object) -> int:
    """Collective (every rank, the default group): the signal some rank or launcher got, else 0; the same on
    every rank."""
    import torch
    import torch.distributed as dist

    local = local_vote()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    vote = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return int(vote.item())
