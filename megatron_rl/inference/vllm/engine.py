"""vLLM as the rollout engine: a fleet of ``vllm serve`` servers, routed, self-healing, fed the weights in place.

Place in the data flow: the main job (or a user's loop) calls ``VLLMEngine.start`` once, ``generate`` per batch
of prompts and ``update_weights`` after the optimizer steps; all three are collective over the trainer's ranks
(``engine.RolloutEngine``). Global rank 0 owns the fleet (``fleet.Fleet``: N ``server.EngineServer``) and talks HTTP to
it; the other ranks get its completions by a broadcast, and the senders of each pipeline stage stream their
weights into every engine (``sync.py``, ``weight_sync.py``)::

    rank 0        Fleet ── route (router.py: a GRPO group -> one engine, least-loaded) ──> N x vllm serve
                    │        one request per group (n samples); sample i's seed = f(call seed, i): any engine,
                    │        any grouping, same sample
    every rank    broadcast of the completions; update_weights: every sender -> every engine's workers

Start-up: the policy's current weights are exported as an HF folder (``<work_dir>/model``; the config comes from
``hf_dir``, or is written from ``model.*`` for a model trained from scratch, ``hf/config.py``); the job starts
``rollout.num_engines`` servers on it (``server.EngineServer.start``: loopback, a free port, a fresh random token
per job that every route requires, ``<work_dir>/engine<i>.log``) and attaches ``rollout.engine_urls``; each
engine joins the weight sync. On a multi-node job each node's local rank 0 starts its share
(``inference/nodes.py``: engine i on node i % nnodes, bound to ``rollout.engine_host``; the token is broadcast)
and rank 0 routes over all; another node's engine that rank 0 marks down is killed and restarted by its node at
the next collective point (``membership.py``).

Self-healing (rank 0, inside ``generate``): an engine that refuses connections, answers 5xx, or makes no progress
(no finished request and no new generated token, ``/metrics``) for ``rollout.request_timeout_s`` is killed; its
unfinished requests go to the engines still serving (same seeds, so the same samples) and a replacement starts in
the background on the initial weights. A replacement serves only after a weight sync has given it the current
weights: at the next ``update_weights``, or at once (a collective sync of it alone) when no engine is left
serving. An engine that cannot be brought back after ``MAX_RESTARTS`` tries in one call raises ``EngineError``
naming its log. ``step_metrics`` reports ``rollout/engine_restarts`` and ``rollout/engines_alive``.

Lifecycle: every server the job starts runs in its own session with a watchdog on rank 0's pid
(``engine_process/vllm_serve.py``), and the processes vLLM starts below it die with their parent
(``PR_SET_PDEATHSIG``), so Ctrl-C, an exception or a SIGKILL of the trainer, of the server, or of both leaves
no engine process; ``close`` (also registered with ``atexit``) kills them at once. Attached servers are never killed.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.distributed.rank0 import broadcast_from_rank0
from megatron_rl.hf.lora import ADAPTER_DIR, export_peft_adapter
from megatron_rl.inference.config import RolloutConfig, engine_dtype
from megatron_rl.inference.engine import Completion, EngineError, EngineStartError, SamplingSpec
from megatron_rl.hf.families import family_of
from megatron_rl.inference.vllm.engine_nodes import EngineHosts
from megatron_rl.inference.nodes import NodeLayout, engine_host, engines_on_node
from megatron_rl.inference.vllm import CAPABILITIES
from megatron_rl.inference.vllm.collective import gather_urls, raise_everywhere
from megatron_rl.inference.vllm.fleet import Fleet
from megatron_rl.inference.vllm.images import EngineImages
from megatron_rl.inference.vllm.launcher import Launcher, engine_python, job_token, serve_options
from megatron_rl.inference.vllm.membership import Membership
from megatron_rl.inference.vllm.server import EngineDown, EngineServer
from megatron_rl.inference.vllm.slot import Slot
from megatron_rl.inference.vllm.sync import WeightSyncing


class VLLMEngine(Membership, WeightSyncing):
    """``RolloutEngine`` backed by a fleet of ``vllm serve`` servers (module docstring). Build with ``start``;
    its membership is ``membership.py``, its weight sync ``sync.py``."""

    capabilities = CAPABILITIES

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
        self.last_stats: dict = {}
        """Rank 0: the last sync's engine and sender statistics (engine: the first engine's)."""
        self.last_sender_tensors = 0
        """Tensors this rank sent in the last sync (0 on a rank that sends nothing)."""
        self.lora = policy.config.model.lora if policy.config.model.lora.enabled else None
        """A LoRA policy's ``model.lora``: the engines serve the base and each sync sends the adapter only."""
        self.last_sync_bytes = 0
        """Bytes one engine received in the last ``update_weights`` (every sender's; disk: the files written, on
        rank 0): the merged model, or a LoRA policy's adapter. The job logs it as ``rollout/weight_sync_bytes``."""
        self._last_seed: int | None = None
        self._seed_calls = 0
        self.token_versions: Counter = Counter()
        """Every rank: generated tokens per weight version (``rollout.partial_rollouts``: the version is the
        number of syncs before the token; ``take_token_versions``)."""
        self.run_on_main_thread: Any = None
        """Set by a caller that generates in a thread while the main thread trains (``job/pipeline.py``): runs a
        collective weight sync (the all-engines-down admission) on the main thread, between training steps."""
        self.serves_images = family_of(policy.config.model).support.vllm_images
        self.layout = NodeLayout()
        self.launcher: Launcher | None = None
        """A node's local rank 0 on a multi-node job (not global rank 0: its ``Fleet`` has one): starts this node's
        engines (``own``)."""
        self.own: dict[int, EngineServer] = {}
        self.hosts: EngineHosts | None = None
        """Rank 0 with ``rollout.engine_nodes``: the engine nodes' hosts (``engine_nodes.py``)."""

    # ---------------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, policy: Any, config: RolloutConfig, *, hf_dir: str | os.PathLike | None = None,
              work_dir: str | os.PathLike, seed: int = 0) -> "VLLMEngine":
        """Export ``policy``'s weights, start the fleet on them, and give every engine the weights (collective)."""
        groups = policy.groups
        work_dir = Path(work_dir).absolute()  # handed to the engines' processes, which run elsewhere
        model_cfg = policy.config.model
        python = engine_python(config) if config.num_engines else None  # same check everywhere: before collectives
        layout = NodeLayout.from_env()
        host = engine_host(config.engine_host, layout.nnodes)
        transport = config.weight_transport
        if transport == "auto":
            transport = "nccl" if groups.device.type == "cuda" else "gloo"
        hf_source, model_dir = _export_start_weights(policy, work_dir, hf_dir, transport)
        lora = model_cfg.lora
        token = [job_token(config) if groups.rank == 0 else None]
        if layout.nnodes > 1:  # every node's local rank 0 starts engines with it (never logged)
            dist.broadcast_object_list(token, src=0)
        launcher = None
        if layout.owner:
            options = serve_options(config, model_cfg, groups.device.type, python=python or "", seed=seed,
                                    model_dir=model_dir)
            launcher = Launcher(options, model_dir, work_dir, token[0], config.num_engines, layout,
                                host, config.engine_nodes)
        own = {}
        if launcher is not None and groups.rank != 0 and layout.nnodes > 1:  # another node: its share, gathered to rank 0 by URL
            own = {i: launcher.launch(i) for i in engines_on_node(config.num_engines, layout.node, layout.nnodes,
                                                                   config.engine_nodes)}
        remote = gather_urls(own) if layout.nnodes > 1 else {}
        fleet, error = None, None
        engine = cls(policy, config, fleet=None, hf_source=hf_source, work_dir=work_dir, transport=transport)
        if groups.rank == 0:
            fleet = Fleet(config, launcher, lora_dir=model_dir / ADAPTER_DIR if lora.enabled else None)
            try:
                if config.engine_nodes:  # engine_nodes.py: the engine hosts start them
                    engine.hosts = EngineHosts.publish(launcher, config.engine_host, config.start_timeout_s)
                    remote.update(engine.hosts.urls())
                fleet.start(remote)
            except EngineStartError as err:
                error = str(err)
        engine.fleet, engine.layout, engine.own = fleet, layout, own
        engine.launcher = launcher if groups.rank != 0 else None
        try:
            raise_everywhere(error, EngineStartError)
            engine._connect_store()
            engine._admit()  # every engine joins the sync; they start on the exported weights (version 0)
        except BaseException:
            engine.close()
            raise
        return engine

    # ---------------------------------------------------------------------------------------------- use
    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int,
                 images: Sequence[Any] | None = None) -> list[Completion]:
        """One completion per prompt, sampled by the fleet, identical on every rank (collective). ``images``: per
        prompt its images (``GeneratorOutput['images']`` entries that carry their sources as ``urls``, or
        ``EngineImages``), for an engine that takes them (``Support.vllm_images``)."""
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
        engine_images = None if images is None else self._engine_images(images, len(prompts))
        while True:
            payload: list = [None]
            if self.groups.rank == 0:
                try:
                    value = self.fleet.generate(prompts, spec, seeds, engine_images)
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

    def _engine_images(self, images: Sequence[Any], n: int) -> list[EngineImages | None]:
        """Per prompt its ``EngineImages`` (None: none): from entries with ``urls`` (their images' sources, in
        order), shared by a group's samples as their entries are."""
        if not self.serves_images:
            raise ValueError(f"prompts with images, but {self.policy.config.model.hf_path!r} is not served with "
                             "images (a vision-language checkpoint, docs/VISION.md section 9)")
        if len(images) != n:
            raise ValueError(f"{len(images)} image lists for {n} prompts")
        token = self._image_token()
        out, made = [], {}
        for entry in images:
            if isinstance(entry, EngineImages) or not entry:
                out.append(entry or None)
                continue
            urls = getattr(entry, "urls", None)
            if urls is None:
                raise ValueError("the vLLM engine needs each prompt's images as sources (``urls``: data URLs), not "
                                 "only their patches (environments/single_turn/images.py: RowImages)")
            out.append(made.setdefault(id(entry), EngineImages(tuple(urls), token)))
        return out

    def _image_token(self) -> int:
        from megatron_rl.hf.config import load_hf_config

        return int(load_hf_config(self.hf_source).image_token_id)

    @property
    def agent_calls(self) -> Fleet | None:
        """Global rank 0's fleet, which serves an agent's single calls (``Fleet.complete``); None elsewhere."""
        return self.fleet

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
        raise_everywhere(error, EngineError)
        self._admit(send=True)

    def sleep(self) -> None:
        """Rank 0: every serving engine frees its device memory (vLLM sleep level 1) while the trainer trains
        (``rollout.sleep_while_training``; other ranks: nothing). ``wake`` before the next sync or generation."""
        self._each_serving("/sleep?level=1")

    def wake(self) -> None:
        self._each_serving("/wake_up")

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

    def close(self) -> None:
        """Stop the job's engines and leave the sync groups (idempotent)."""
        if self.fleet is not None:
            self.fleet.kill_all()
            self.fleet = None
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None
        for server in self.own.values():
            server.kill()
        self.own = {}
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.store = None
        if self.transport == "disk" and not self.config.sync_dir and self.groups.rank == 0:
            shutil.rmtree(self._sync_dir(), ignore_errors=True)  # the default one under /dev/shm: ours alone


def _export_start_weights(policy: Any, work_dir: Path, hf_dir: str | os.PathLike | None,
                          transport: str) -> tuple[str, Path]:
    """Collective: the policy's weights as the HF folder ``<work_dir>/model`` the engines start on (a LoRA policy:
    the base, and its adapter beside it, which the engines load at start and each sync replaces in memory).
    Returns the HF config's source (``hf_dir``, or one written from ``model.*``) and the folder."""
    from megatron_rl.hf.config import write_hf_config
    from megatron_rl.hf.weights import export_hf

    groups, model_cfg = policy.groups, policy.config.model
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
    return hf_source, model_dir


def start_fleet(config: Any, policy: Any) -> VLLMEngine:
    """``rollout.engine=vllm`` (the registry's factory, ``inference/registry.py``): say what starts (rank 0), then
    ``VLLMEngine.start`` on the job's config (``JobConfig``). Collective; EngineStartError when it cannot start."""
    work_dir = Path(config.rl.logging.output_dir) / "engine"
    if policy.groups.rank == 0:
        rollout = config.rollout
        what = f"{rollout.num_engines} vLLM engine(s)" + (f" + {len(rollout.engine_urls)} attached"
                                                          if rollout.engine_urls else "")
        print(f"megatron_rl main job: starting {what} (logs: {work_dir}/engine<i>.log)", flush=True)
        print(describe_engine_dtype(config), flush=True)
    try:
        return VLLMEngine.start(policy, config.rollout, hf_dir=config.rl.model.hf_path, work_dir=work_dir,
                                seed=config.rl.seed)
    except ValueError as err:  # no engine environment, or a setting the fleet cannot take
        raise EngineStartError(str(err)) from err


def describe_engine_dtype(config: Any) -> str:
    """The start-up line: the vLLM engine's dtype, why, and the log-prob agreement it allows."""
    from megatron_rl.inference.config import agreement_bound, on_policy

    model = config.rl.model
    dtype, why = engine_dtype(config.rollout, model, config.rl.parallel.device)
    bound = agreement_bound(dtype, model.params_dtype)
    checked = ("checked every step" if on_policy(config.rollout, config.job.temperature, config.job.top_p)
               else "not checked: the rollouts are not on-policy")
    return (f"megatron_rl main job: vLLM engine dtype {dtype} ({why}); trainer {model.params_dtype}; "
            f"engine vs trainer log-probs of the sampled tokens within {bound:.3g} on average ({checked})")
