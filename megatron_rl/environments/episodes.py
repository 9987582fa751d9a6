"""Episodes of user code under a time limit (``job.episode_timeout_s``).

Place in the data flow: ``agent/environment.py: AgentEnvironment.play`` (global rank 0) runs each episode's
``function(base_url, **row)`` through ``run_episodes``::

    episodes -> up to ``concurrency`` daemon threads -> each done, or given up past ``timeout_s`` (``on_timeout``)
                          every ``SLOW_REPORT_S`` while some run longer than that: one line naming them

Python cannot stop a thread, so an episode past its limit is *given up*: it counts as failed and the step goes on,
while its function runs on in the background until it returns (its result is dropped). The threads are daemons and
the main thread waits in short slices, so neither a hung episode nor the end of the process waits on one, and
Ctrl-C is never stuck behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

SLOW_REPORT_S = 60.0
"""Seconds between the lines that name the episodes the step is still waiting on (tests lower it)."""


def run_episodes(items: Sequence[Any], work: Callable[[Any], None], *, concurrency: int, timeout_s: float,
                 on_timeout: Callable[[Any, float], None], describe: Callable[[Any], str], what: str) -> None:
    """``work(item)`` for every item, at most ``concurrency`` at once; one still running ``timeout_s`` after it
    started is given up (``on_timeout(item, seconds)``). Returns when every item is done or given up."""
    done: set[int] = set()
    changed = threading.Condition()

    def body(i: int) -> None:
        try:
            work(items[i])
        finally:
            with changed:
                done.add(i)
                changed.notify_all()

    waiting, running = list(range(len(items))), {}
    next_report = time.monotonic() + SLOW_REPORT_S
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.pop(0)
            running[i] = time.monotonic()
            threading.Thread(target=body, args=(i,), name=f"megatron_rl-episode-{i}", daemon=True).start()
        with changed:
            changed.wait(timeout=0.5)
            finished = done & running.keys()
        for i in finished:
            running.pop(i)
        now = time.monotonic()
        for i, started in list(running.items()):
            if now - started > timeout_s:
                running.pop(i)
                on_timeout(items[i], now - started)
        if now >= next_report:
            next_report = now + SLOW_REPORT_S
            slow = sorted(((now - started, i) for i, started in running.items() if now - started > SLOW_REPORT_S),
                          reverse=True)
            if slow:
                names = ", ".join(f"{describe(items[i])} ({seconds:.0f} s)" for seconds, i in slow[:8])
                print(f"megatron_rl: the step waits on {len(slow)} {what} running for over {SLOW_REPORT_S:g} s: "
                      f"{names}{', ...' if len(slow) > 8 else ''}; each is given up at job.episode_timeout_s="
                      f"{timeout_s:g}", flush=True)
