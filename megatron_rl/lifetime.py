"""Helper processes that die with their parent.

``die_with_parent``: in a child process, ask the kernel for SIGKILL when the parent (strictly: the thread that
forked it) ends (``prctl(PR_SET_PDEATHSIG)``, Linux; a no-op elsewhere).
"""

from __future__ import annotations

import signal
import sys


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child: the kernel sends ``sig`` when the parent ends (``PR_SET_PDEATHSIG``); no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig))
