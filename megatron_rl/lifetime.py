"""Helper processes that die with their parent and start without re-importing the caller's main module.

``die_with_parent``: in a child process, ask the kernel for SIGKILL when the parent (strictly: the thread that
forked it) ends (``prctl(PR_SET_PDEATHSIG)``, Linux; a no-op elsewhere).

``bare_main``: while a ``spawn``-context helper process starts, hide the caller's ``__main__`` from
multiprocessing. A spawned child otherwise imports the parent's main module first (for ``python -m
megatron_rl.job.main``: torch, megatron-core and the job, ~5 s of CPU per child on the 2-core machine, and a
``KeyboardInterrupt`` traceback from that import on Ctrl-C). The helpers started under it run functions of
light modules only (``multiprocessing.managers`` and this one), which their pickles name themselves.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import types
from collections.abc import Iterator


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child: the kernel sends ``sig`` when the parent ends (``PR_SET_PDEATHSIG``); no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig))


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """Spawned children started inside this block do not import the caller's ``__main__`` (module docstring)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__mp_main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main
