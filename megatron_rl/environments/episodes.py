"""Episodes of user code under a time limit (``job.episode_timeout_s``).

Place in the data flow: ``agent/environment.py: AgentEnvironment.play`` (global rank 0) runs each episode's
``function(base_url, **row)`` through ``run_episodes``; ``step_api/environment.py`` (every rank) runs each call
into the user's class through ``call_within`` (the episode's time left), then the ranks agree on which episodes
ran out (``distributed/rank0.union_over_ranks``)::

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


class EpisodeTimeout(Exception):
    """An episode's call was still running when its time ran out (``call_within``)."""


def call_within(fn: Callable[[], Any], seconds: float, describe: Callable[[], str]) -> Any:
    """``fn()`` on a daemon thread; its result (or its exception), or ``EpisodeTimeout`` when it has not returned
    within ``seconds`` (it runs on in the background). Every ``SLOW_REPORT_S`` meanwhile, one line naming it."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            outcome["error"] = err

    worker = threading.Thread(target=body, name="megatron_rl-episode-call", daemon=True)
    started = time.monotonic()
    worker.start()
    next_report = started + SLOW_REPORT_S
    while worker.is_alive():
        now = time.monotonic()
        if now - started >= seconds:
            raise EpisodeTimeout(f"still running after {now - started:.0f} s")
        worker.join(timeout=min(0.5, max(seconds - (now - started), 0.01)))
        if time.monotonic() >= next_report and worker.is_alive():
            next_report += SLOW_REPORT_S
            print(f"megatron_rl: the step waits on {describe()}, running for {time.monotonic() - started:.0f} s; "
                  f"it is given up at job.episode_timeout_s", flush=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def run_episodes(items: Sequence[Any], work: Callable[[Any], None], *, concurrency: int, timeout_s: float,
                 on_timeout: Callable[[Any, float], None], describe: Callable[[Any], str], what: str,
                 paused: Callable[[], bool] | None = None) -> None:
    """``work(item)`` for every item, at most ``concurrency`` at once; one still running ``timeout_s`` after it
    started is given up (``on_timeout(item, seconds)``); time while ``paused()`` (no engine serves: the calls
    wait for a replacement) does not count. Returns when every item is done or given up."""
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
    last = time.monotonic()
    next_report = last + SLOW_REPORT_S
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
        if paused is not None and paused():  # the clock of every running episode stops meanwhile
            running = {i: started + (now - last) for i, started in running.items()}
        last = now
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
