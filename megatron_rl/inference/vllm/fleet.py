"""Rank 0's fleet of engines (``Fleet``): start, health, restarts; its requests are ``calls.py``.

Place in the data flow: global rank 0 of the trainer only, never inside a collective: ``VLLMEngine`` (``engine.py``)
drives it; it holds a ``Slot`` (``slot.py``) per engine, each an ``EngineServer`` (``server.py``) it launched
(``launcher.py``), another node's, or attached (``rollout.engine_urls``). An engine marked down is killed and a
replacement launched in the background; it joins at the next collective point (``membership.py``).
"""

from __future__ import annotations

import atexit
import concurrent.futures as futures
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.engine import Completion, EngineError, EngineStartError
from megatron_rl.inference.nodes import engine_node
from megatron_rl.inference.vllm.calls import FleetCalls
from megatron_rl.inference.vllm.launcher import Launcher
from megatron_rl.inference.vllm.server import LORA_NAME, MODEL_NAME, EngineDown, EngineServer, log_tail
from megatron_rl.inference.vllm.slot import MAX_RESTARTS, Slot


class Fleet(FleetCalls):
    """Rank 0's engines (not collective): start, health, restart (here), route and retry (``calls.py``).
    ``VLLMEngine`` drives it."""

    def __init__(self, config: RolloutConfig, launcher: Launcher, *, lora_dir: Path | None = None) -> None:
        self.config = config
        self.launcher = launcher
        self.work_dir = launcher.work_dir
        self.token = launcher.token
        self.slots: list[Slot] = []
        self.restarts_in_step = 0
        self.closed = False
        """Set by ``kill_all``: no more restarts."""
        self.sessions: dict[str, int] = {}
        """Agent session -> the engine its calls go to (``complete``)."""
        self.partial: dict[int, Completion] | None = None
        """The samples finished so far of a ``generate`` call that returned None (it is called again); None between
        calls."""
        self.lora_dir = lora_dir
        """A LoRA policy's initial adapter (``<work_dir>/model/adapter``): the engines load it at start (then every
        sync replaces its tensors in memory); None without LoRA."""
        self.model = LORA_NAME if lora_dir is not None else MODEL_NAME
        """What every rollout request names: the base, or the policy's LoRA adapter."""
        self.calls_waiting = threading.Event()
        """Set while an agent call waits for a replacement engine (none serves): the caller's loop runs the
        collective admission (``VLLMEngine.admit_replacements``) that makes it serve."""
        self.lock = threading.RLock()
        atexit.register(self.kill_all)

    # ------------------------------------------------------------------------------------------- start
    def start(self, remote: dict[int, str] | None = None) -> None:
        """Launch this node's servers, take the other nodes' (``remote``: index -> URL) and the user's, wait until
        all answer (EngineStartError otherwise)."""
        nnodes = self.launcher.layout.nnodes
        for i in range(self.config.num_engines):
            slot = Slot(index=i, node=engine_node(i, nnodes, self.launcher.engine_nodes))
            slot.server = self.launcher.launch(i) if slot.node == self.launcher.layout.node else self._remote(i, remote[i])
            self.slots.append(slot)
        for url in self.config.engine_urls:
            self.slots.append(Slot(index=len(self.slots), server=EngineServer.attach(url, self.token)))
        for slot in self.slots:
            try:
                slot.server.wait_ready(self.config.start_timeout_s, what=f"vLLM engine {slot.index}")
                if self.lora_dir is not None and not slot.server.owned:
                    self._register_adapter(slot)
            except EngineStartError:
                self.kill_all()
                raise
            slot.state = "joining"

    def _register_adapter(self, slot: Slot) -> None:
        """An attached server learns the adapter's name from its path (``/v1/load_lora_adapter``: the server must
        read ``self.lora_dir``, a shared file system; docs/INFERENCE.md); later syncs replace it in memory."""
        try:
            slot.server.call("POST", "/v1/load_lora_adapter", {"lora_name": LORA_NAME, "lora_path": str(self.lora_dir)},
                             timeout_s=self.config.start_timeout_s)
        except (EngineError, EngineDown) as err:
            raise EngineStartError(
                f"vLLM engine {slot.index} at {slot.server.url} did not load the LoRA adapter {self.lora_dir} "
                f"({err}); start it with --enable-lora --max-lora-rank <model.lora.rank> and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on a file system that holds the job's work_dir "
                "(docs/INFERENCE.md)") from None

    def _remote(self, index: int, url: str) -> EngineServer:
        """Another node's engine: a URL here (its log is ``<work_dir>/engine<i>.log`` on that node)."""
        return EngineServer(url, self.token, log_path=self.work_dir / f"engine{index}.log")

    # ------------------------------------------------------------------------------------------- health
    def serving(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "serving"]

    def ready_to_join(self) -> list[Slot]:
        """Slots whose (new) engine is up and needs the current weights."""
        self._collect_restarts()
        return [s for s in self.slots if s.state == "joining"]

    def mark_down(self, slot: Slot, reason: str) -> None:
        """Take ``slot`` out of service, kill its engine, and start a replacement in the background."""
        with self.lock:
            if slot.state in ("dead", "starting"):
                return
            slot.state = "dead"
            if slot.down_since is None:
                slot.down_since = time.monotonic()
        remote = slot.node != self.launcher.layout.node and slot.index < self.config.num_engines
        print(f"megatron_rl: vLLM {slot.name} is down ({reason.splitlines()[0][:300]}); "
              + ("its node restarts it at the next weight sync" if remote else "restarting it"
                 if slot.server is not None and slot.server.owned else "it was attached: not restarted"), flush=True)
        if remote:
            slot.error = reason
            slot.remote_restart = slot.restarts < MAX_RESTARTS
            return
        if slot.server is None or not slot.server.owned:
            slot.error = reason
            return
        slot.server.kill()  # (until its replacement is launched the slot is 'dead' without an error: ``coming``)
        self._restart(slot, reason)

    def coming(self, slot: Slot) -> bool:
        """This node's replacement for ``slot`` is on its way: launched, up and waiting to join, or marked down a
        moment ago and being killed before its replacement is launched (``mark_down``)."""
        return slot.state in ("starting", "joining") or (slot.state == "dead" and slot.error is None
                                                         and not self.closed)

    def _restart(self, slot: Slot, reason: str) -> None:
        """Launch a replacement for ``slot`` and wait for it in the background (it joins when up); a replacement
        that dies while starting is replaced again, up to ``MAX_RESTARTS``."""
        if self.closed:
            return
        if slot.restarts >= MAX_RESTARTS:
            slot.error = f"{reason}; restarted {slot.restarts} times already"
            slot.state = "dead"
            return
        self._count_restart(slot)
        try:
            slot.server = self.launcher.launch(slot.index)
        except Exception as err:  # no process at all (e.g. the engine's Python is gone): nothing is coming
            slot.state, slot.error = "dead", f"{reason}; its replacement could not be launched: {err}"
            return
        self._wait_in_background(slot, lambda err: self._restart(slot, err))

    def _count_restart(self, slot: Slot) -> None:
        slot.restarts += 1
        self.restarts_in_step += 1
        slot.generation += 1
        slot.state = "starting"

    def _wait_in_background(self, slot: Slot, failed: Any) -> None:
        """Wait for ``slot``'s new server in a thread: 'joining' when it answers, else ``failed(reason)``."""
        server = slot.server

        def wait() -> None:
            try:
                server.wait_ready(self.config.start_timeout_s, what=f"vLLM engine {slot.index} (restart)")
                slot.state = "joining"
            except EngineStartError as err:
                server.kill()
                if not self.closed:  # (killed by ``kill_all``: the job is ending)
                    failed(str(err))

        slot.restarter = threading.Thread(target=wait, name=f"megatron_rl-restart-{slot.index}", daemon=True)
        slot.restarter.start()

    def remote_restarts(self) -> list[int]:
        """The other nodes' engines to restart now (counted as restarts; their owners start the replacements)."""
        wanted = [s for s in self.slots if s.remote_restart and not self.closed]
        for slot in wanted:
            slot.remote_restart = False
            self._count_restart(slot)
        return [s.index for s in wanted]

    def adopt(self, index: int, url: str) -> None:
        """Another node restarted engine ``index`` at ``url``: wait for it in the background, then it joins."""
        slot = self.slots[index]
        slot.server = self._remote(index, url)

        def failed(reason: str) -> None:
            slot.state, slot.error = "dead", reason
            slot.remote_restart = slot.restarts < MAX_RESTARTS

        self._wait_in_background(slot, failed)

    def _collect_restarts(self) -> None:
        for slot in self.slots:
            if slot.restarter is not None and not slot.restarter.is_alive():
                slot.restarter = None

    def wait_for_replacement(self) -> list[Slot]:
        """No engine serves: wait for the replacements; returns those ready to join. EngineError when none
        can come back."""
        while True:
            joining = self.ready_to_join()
            if joining:
                return joining
            if not any(self.coming(s) for s in self.slots):  # (another node restarts its own at the next
                # collective point, not during this wait)
                dead = [s for s in self.slots if s.state == "dead"]
                worst = dead[0] if dead else None
                detail = f"{worst.error}\nlast lines of {worst.server.log_path if worst.server else '-'}:\n" \
                         f"{log_tail(worst.server.log_path if worst.server else None)}" if worst else ""
                raise EngineError(f"no vLLM engine is serving and none could be brought back ({len(dead)} down): "
                                  f"{detail}")
            time.sleep(0.5)

    def take_restarts(self) -> int:
        count, self.restarts_in_step = self.restarts_in_step, 0
        return count

    def kill_all(self) -> None:
        self.closed = True
        for slot in self.slots:
            if slot.server is not None:
                slot.server.kill()
        atexit.unregister(self.kill_all)

    # ------------------------------------------------------------------------------------------- control calls
    def each(self, slots: Sequence[Slot], call: Any) -> dict[int, Any]:
        """``call(slot)`` on every slot concurrently; per slot its result or the exception it raised."""
        results: dict[int, Any] = {}
        with futures.ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
            running = {pool.submit(call, slot): slot.index for slot in slots}
            for future in futures.as_completed(running):
                try:
                    results[running[future]] = future.result()
                except Exception as err:  # noqa: BLE001 - handed back to the caller, which decides
                    results[running[future]] = err
        return results
