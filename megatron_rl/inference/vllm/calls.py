"""The fleet's requests (rank 0, not collective): a ``generate`` call routed over the serving engines, retried
on the others when one fails or hangs; an agent session's single calls.

Place in the data flow: ``VLLMEngine.generate`` (``engine.py``) -> ``Fleet.generate`` (here, a part of ``Fleet``,
``fleet.py``) -> ``router.route`` (a GRPO group -> one engine, least-loaded) -> ``EngineServer.sample`` per group;
an agent's calls (``environments/agent/``) -> ``Fleet.complete``.
"""

from __future__ import annotations

import concurrent.futures as futures
import threading
import time
from typing import Any

from megatron_rl.inference.engine import Completion, EngineError, SamplingSpec
from megatron_rl.inference.vllm.images import EngineImages
from megatron_rl.inference.vllm.router import requests, route
from megatron_rl.inference.vllm.server import EngineDown
from megatron_rl.inference.vllm.slot import Slot

GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (vllm 0.32 ``sampling_params._SAMPLING_EPS``) and then refuses
``n > 1``: such calls send one request per sample."""


class FleetCalls:
    """The requests half of ``Fleet`` (``fleet.py``), which holds the slots, the lock and the sessions these use."""

    config: Any
    slots: list[Slot]
    sessions: dict[str, int]
    partial: dict[int, Completion] | None
    model: str
    calls_waiting: threading.Event
    lock: threading.RLock

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int],
                 images: list[EngineImages | None] | None = None) -> list[Completion] | None:
        """Every prompt's completion, or None when no engine serves and replacements must be synced first
        (the caller runs that collective sync and calls again; finished samples are kept in ``self.partial``).
        ``images``: per prompt its images (None: text only); a group is a prompt with its images."""
        if self.partial is None:  # a new call, not the same one again after an admission
            self.partial = {}
            for slot in self.serving():  # MAX_RESTARTS counts the restarts of one call, admissions included (a
                slot.restarts = 0  # request that kills every engine it reaches stops after them)
        done = self.partial
        try:
            while len(done) < len(prompts):
                serving = self.serving()
                if not serving:
                    return None
                todo = [i for i in range(len(prompts)) if i not in done]
                keys = None if images is None else [(tuple(prompts[i]), images[i]) for i in todo]
                engines = route([prompts[i] for i in todo], [s.index for s in serving], max_tokens=spec.max_tokens,
                                keys=keys)
                self._round(todo, engines, prompts, spec, seeds, done, images)
        except BaseException:
            self.partial = None
            raise
        self.partial = None
        return [done[i] for i in range(len(prompts))]

    def _round(self, todo: list[int], engines: list[int], prompts: list[list[int]], spec: SamplingSpec,
               seeds: list[int], done: dict[int, Completion], images: list[EngineImages | None] | None) -> None:
        """Send ``todo`` to ``engines`` concurrently; collect what finishes; mark engines that fail or hang."""
        timeout = self.config.request_timeout_s
        slots = {s.index: s for s in self.slots}
        outstanding: dict[int, int] = {}
        last_progress: dict[int, float] = {}
        tokens_seen: dict[int, float] = {}
        grouped = prompts if images is None else [(*p, images[i]) for i, p in enumerate(prompts)]  # same images too
        batches = requests(todo, engines, grouped, seeds, greedy=spec.temperature < GREEDY_BELOW)
        with futures.ThreadPoolExecutor(max_workers=min(len(batches), 64 * max(1, len(set(engines))))) as pool:
            pending = {}
            for samples, engine in batches:  # one request per group (router.py): n samples, seeds seed, seed + 1, ...
                server = slots[engine].server
                pending[pool.submit(server.sample, prompts[samples[0]], spec, seed=seeds[samples[0]], n=len(samples),
                                    timeout_s=timeout + 60, model=self.model,
                                    versioned=self.config.partial_rollouts,
                                    **({} if images is None else {"images": images[samples[0]]}))] = (samples, engine)
                outstanding[engine] = outstanding.get(engine, 0) + 1
                last_progress[engine] = time.monotonic()
            while pending:
                finished, _ = futures.wait(pending, timeout=1.0, return_when=futures.FIRST_COMPLETED)
                for future in finished:
                    samples, engine = pending.pop(future)
                    outstanding[engine] -= 1
                    try:
                        done.update(zip(samples, future.result()))
                        last_progress[engine] = time.monotonic()
                    except EngineDown as err:
                        self.mark_down(slots[engine], str(err))
                for engine, count in outstanding.items():
                    slot = slots[engine]
                    if count and slot.state == "serving" and time.monotonic() - last_progress[engine] > timeout:
                        if self._made_progress(slot, tokens_seen):
                            last_progress[engine] = time.monotonic()
                        else:
                            self.mark_down(slot, f"no progress for {timeout:.0f} s (rollout.request_timeout_s)")

    def complete(self, prompt: list[int], spec: SamplingSpec, *, seed: int, session: str,
                 images: EngineImages | None = None) -> Completion:
        """One request of an agent session (rank 0 only, not collective, thread-safe): the session's calls stay
        on one engine while it serves (its prefix cache); an engine that fails is marked down and the call goes
        to another with the same seed. When no engine serves, the call waits for a replacement (it serves once
        the caller's loop has admitted it: ``calls_waiting``), at most ``rollout.start_timeout_s``; EngineError
        when none can come back or that passes. ``images``: the prompt's images (an engine that takes them)."""
        waiting_since = None
        while True:
            with self.lock:
                serving = self.serving()
                if serving:
                    engine = self.sessions.get(session)
                    if engine is None or self.slots[engine].state != "serving":
                        load = {s.index: 0 for s in serving}
                        for pinned in self.sessions.values():
                            if pinned in load:
                                load[pinned] += 1
                        engine = min(load, key=lambda e: (load[e], e))
                        self.sessions[session] = engine
            if not serving:
                waiting_since = self._wait_for_serving(waiting_since)
                continue
            slot = self.slots[engine]
            try:
                return slot.server.complete(prompt, spec, seed=seed, timeout_s=self.config.request_timeout_s,
                                            model=self.model, versioned=self.config.partial_rollouts,
                                            **({} if images is None else {"images": images}))
            except EngineDown as err:
                self.mark_down(slot, str(err))

    def _wait_for_serving(self, since: float | None) -> float:
        """An agent call found no engine serving: flag it (``calls_waiting``) and wait a moment; EngineError when
        no replacement is coming or ``rollout.start_timeout_s`` has passed since ``since``. Returns ``since``."""
        since = since or time.monotonic()
        coming = [s for s in self.slots if self.coming(s) or s.remote_restart]  # (another node's: at the admission)
        waited = time.monotonic() - since
        if not coming or waited > self.config.start_timeout_s:
            raise EngineError(f"no vLLM engine is serving this agent call and "
                              f"{'none is coming back' if not coming else 'none came back'} within {waited:.0f} s "
                              f"(rollout.start_timeout_s={self.config.start_timeout_s:g})")
        self.calls_waiting.set()
        time.sleep(0.2)
        return since

    def end_session(self, session: str) -> None:
        with self.lock:
            self.sessions.pop(session, None)

    @staticmethod
    def _made_progress(slot: Slot, seen: dict[int, float]) -> bool:
        try:
            tokens = slot.server.generated_tokens()
        except (EngineDown, EngineError):
            return False
        before = seen.get(slot.index)
        seen[slot.index] = tokens
        return before is None or tokens > before

