"""Stream the policy's weights, in HF names and buckets, into a running rollout engine.

Place in the data flow: after the optimizer steps of an RL step (every ``rollout.sync_interval`` steps), before
the next rollouts; ``VLLMEngine.update_weights`` calls ``WeightSender.send`` on every trainer rank.

Who sends what (no full gather anywhere)::

    every rank of PP stage p    TP gather of one tensor at a time to the stage's TP rank 0 (hf/weights.py:
                                iter_stage_hf_weights; the other TP ranks only send their shards); MoE under
                                expert parallelism: the EP ranks of the sender's EP group send their experts
                                to it, one expert tensor at a time (point to point; other EP groups send none)
    sender of stage p           the rank with tp = dp = cp = 0 of stage p; packs the converted HF tensors into
                                a bucket of ``bucket_bytes`` (one preallocated uint8 buffer) and broadcasts each
                                full bucket to the engine's workers over its own group {sender p, workers}
    engine workers              receive stage 0's buckets, then stage 1's, ... (vllm_worker.py) and feed them
                                to vLLM's in-place ``reload_weights`` as one stream

A tensor larger than a bucket goes alone, as its own message. The sender's extra memory is therefore about
one bucket plus the largest (gathered, converted) tensor. Each bucket's manifest (names, dtypes, shapes,
offsets) goes through the shared ``TCPStore`` just before its bytes (``vllm_worker.bucket_key``).

The transport is a raw ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU; unmeasured) built on the store:
the trainer's and the engine's torch.distributed default groups stay untouched.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.inference.engine_process.vllm_worker import broadcast, bucket_key


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0


def is_sender(groups: ParallelGroups) -> bool:
    """One sender per pipeline stage: its TP, DP and CP rank 0 (also EP rank 0: EP ranks are DP ranks of the dense
    layers, and the stage's first rank is rank 0 of every group; so it is a stream root of
    ``iter_stage_hf_weights``, which receives the experts of every EP rank)."""
    return groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0


class WeightSender:
    """This rank's part of the weight sync (a sender or a TP helper of one); collective over the trainer ranks.

    ``join`` runs while one engine's workers join the same groups (``megatron_rl_join``).
    """

    def __init__(self, groups: ParallelGroups, *, bucket_bytes: int, backend: str) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.groups = groups
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend
        self.sender = is_sender(groups)
        assert not self.sender or groups.ep_rank == 0, "the sender must be the root of its EP group"
        self.device = torch.device("cpu") if backend == "gloo" else groups.device
        self.engine_groups: dict[str, Any] = {}
        """Engine (its group prefix) -> the group {this sender, that engine's workers}."""
        self.store: Any = None
        self.bridge: Any = None
        """mbridge's converter for this stage, built at the first ``send``."""
        self.skip_bucket: int | None = None
        """Test hook: drop the bucket with this index (a planted bug the sync tests must catch)."""

    def connect(self, host: str, port: int, timeout_s: float) -> None:
        """The sender's client of the trainer's ``TCPStore`` (bucket manifests, group rendezvous)."""
        if self.sender:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    def join(self, prefix: str, num_workers: int, timeout_s: float) -> None:
        """Form the group {this sender, the ``num_workers`` workers of the engine ``prefix``} (the engine's
        workers join at the same time: ``vllm_worker.WorkerExtension.megatron_rl_join``)."""
        if not self.sender:
            return
        from megatron_rl.inference.engine_process.vllm_worker import new_group

        old = self.engine_groups.pop(prefix, None)
        if old is not None:
            _shutdown(old)
        store = dist.PrefixStore(f"{prefix}/sender{self.groups.pp_rank}", self.store)
        self.engine_groups[prefix] = new_group(store, 0, 1 + num_workers, self.backend, timeout_s)

    def send(self, model_chunks: list[torch.nn.Module], hf_dir: str, version: int,
             engines: list[str] | None = None) -> SyncStats:
        """Stream this stage's weights as version ``version`` into ``engines`` (group prefixes; None = every
        engine joined), one bucket at a time to each (collective over the TP group of the stage)."""
        from megatron_rl.hf.weights import bridge_for, iter_stage_hf_weights

        if self.bridge is None:  # the model's layout and HF config do not change between syncs
            self.bridge = bridge_for(model_chunks, hf_dir, self.groups)
        return self.send_tensors(iter_stage_hf_weights(model_chunks, hf_dir, self.groups, bridge=self.bridge),
                                 version, engines)

    def send_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     engines: list[str] | None = None) -> SyncStats:
        """Stream ``(name, tensor)`` pairs as version ``version`` into ``engines`` in buckets (a sender sends what
        it is given, the other ranks only run ``tensors`` to the end: it may be a collective). ``send`` streams
        the stage's HF weights; a LoRA policy's sync streams its adapter (``sync.py: WeightSyncing._sync``)."""
        started = time.perf_counter()
        self.targets = {p: self.engine_groups[p] for p in (engines if engines is not None else self.engine_groups)} \
            if self.sender else {}
        stats = SyncStats()
        bucket = _Bucket(self.bucket_bytes, self.device) if self.sender else None
        index = 0
        for name, tensor in tensors:
            if bucket is None:
                continue
            if not bucket.fits(tensor) and bucket.entries:
                self._flush(bucket, version, index, last=False, stats=stats)
                index += 1
            if bucket.fits(tensor):
                bucket.add(name, tensor)
            else:  # larger than a bucket: sent alone
                self._send(_single(name, tensor), version, index, last=False, stats=stats)
                index += 1
            del tensor  # not alive while the next one is gathered
        if bucket is not None:
            self._flush(bucket, version, index, last=True, stats=stats)
        stats.seconds = time.perf_counter() - started
        return stats

    def _flush(self, bucket: "_Bucket", version: int, index: int, *, last: bool, stats: SyncStats) -> None:
        self._send(bucket.message(), version, index, last=last, stats=stats)
        bucket.clear()

    def _send(self, message: tuple[list, torch.Tensor], version: int, index: int, *, last: bool,
              stats: SyncStats) -> None:
        entries, payload = message
        if self.skip_bucket == index:
            entries = []  # the bytes travel, the engine loads none of them
        manifest = {"nbytes": int(payload.numel()), "last": last, "tensors": entries}
        self.store.set(bucket_key(version, self.groups.pp_rank, index), json.dumps(manifest))
        for prefix, group in list(self.targets.items()):
            try:
                broadcast(group, payload)
            except RuntimeError:  # the engine died (its peer closed): the others still get this version; rank 0
                del self.targets[prefix]  # marks it down from its RPC (sync.py: WeightSyncing._failures)
                _shutdown(self.engine_groups.pop(prefix))
        stats.bytes += int(payload.numel())
        stats.tensors += len(entries)
        stats.buckets += 1

    def raw_send(self, prefix: str, nbytes: int, repeats: int) -> float:
        """Sender 0: ``repeats`` plain broadcasts of ``nbytes`` to engine ``prefix`` (pairs with its
        ``raw_receive``)."""
        payload = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        started = time.perf_counter()
        for _ in range(repeats):
            broadcast(self.engine_groups[prefix], payload)
        return time.perf_counter() - started

    def close(self) -> None:
        for group in self.engine_groups.values():
            _shutdown(group)
        self.engine_groups = {}
        self.store = None


def _shutdown(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - a group whose engine is gone: nothing left to release
            pass


class _Bucket:
    """One preallocated flat byte buffer that converted tensors are copied into back to back."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.used = 0
        self.entries: list[list] = []

    def fits(self, tensor: torch.Tensor) -> bool:
        return self.used + _nbytes(tensor) <= self.capacity

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        nbytes = _nbytes(tensor)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.buffer[self.used:self.used + nbytes].copy_(flat)
        self.entries.append([name, _dtype_name(tensor), list(tensor.shape), self.used, nbytes])
        self.used += nbytes

    def message(self) -> tuple[list, torch.Tensor]:
        if self.buffer is None:
            return [], torch.empty(0, dtype=torch.uint8, device=self.device)
        return list(self.entries), self.buffer[:self.used]

    def clear(self) -> None:
        self.used = 0
        self.entries = []


def _single(name: str, tensor: torch.Tensor) -> tuple[list, torch.Tensor]:
    payload = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return [[name, _dtype_name(tensor), list(tensor.shape), 0, _nbytes(tensor)]], payload


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
