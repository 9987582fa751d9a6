"""Resident-memory probes shared by the CPU benchmarks (Linux ``/proc``; glibc's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import gc


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB, e.g. ``VmRSS`` (resident now) or ``VmHWM`` (peak resident)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def release_heap() -> None:
    """Collect garbage and hand freed heap back to the OS, so a following peak measures the step alone."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed memory may stay resident (measurement is then lower)
        pass
