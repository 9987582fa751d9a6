"""Mixture-of-experts against a dense model with the same active parameters per token: step time and memory.

    .venv/bin/python bench/bench_moe.py [--sequences 16] [--length 256] [--reps 5] [--ep2] [--quick]
    # GPU (not measured here): python bench/bench_moe.py --device cuda --sequences 64 --length 1024 --ep2

Place in the data flow (docs/DESIGN.md section 1): the "Megatron model" and "optimizer" stages through the
library's own API. A *step* is ``MegatronPolicy.forward_backward`` (planning, packing, megatron-core's schedule,
forward and backward, and for the MoE model its router, alltoall dispatcher and per-sequence load-balancing and
z-loss) plus ``optim_step`` (DDP finalize, clip, Adam, LR schedule) on one batch of single-turn sequences with
``loss = -sum(logprob * loss_mask)``. Two models, built side by side in each process, take the same tokens:

    moe      every layer's MLP is ``--experts`` SwiGLU experts of width ``--moe-ffn``, top-``--topk`` routing
    dense    every layer's MLP is one SwiGLU of width topk x moe-ffn: the same active parameters per token (but
             the MoE model's routers, hidden x experts per layer)

(attention, embeddings and norms are identical). Steps are interleaved (the order alternates every repetition)
after one warm-up step each; the table gives the median and the minimum. Layouts: one rank, and with ``--ep2`` two
gloo ranks (MoE at EP2: each rank holds half of the experts and its DP half of the batch; dense at DP2; the time is
the slower rank's). Every layout is a fresh group of spawned processes (one torch thread each by default).

Memory, per rank: "state MiB" is the bytes of the tensors the model keeps between steps (weights, DDP's gradient
buffers, Adam's moments; each storage counted once), after its warm-up step; "step peak MiB" is the memory a step
adds on top: ``VmHWM - VmRSS`` over one step after ``malloc_trim`` and a reset of the kernel's peak counter
(``/proc/self/clear_refs``; activations, autograd state, dispatch buffers, temporaries), on a GPU the peak of
``torch.cuda.memory_allocated`` during the step minus its value before.

Sanity checks (non-zero exit): every loss is finite, each model's ranks agree on the loss, the dense model has
exactly the MoE model's active parameters per token but its routers (hidden x experts per layer), the MoE model
has more parameters in total.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from procmem import release_heap, status_kib
from workloads import IndependentSpec, check, independent_workload, markdown_table, print_report_or_exit

VOCAB = 512
MODELS = ("moe", "dense")


@dataclass(frozen=True)
class Shape:
    """The two models (``--hidden``, ``--layers``, ``--experts``, ``--topk``, ``--moe-ffn``)."""

    layers: int = 2
    hidden: int = 256
    experts: int = 8
    topk: int = 2
    moe_ffn: int = 256


def model_config(shape: Shape, kind: str, max_len: int):
    """The ``ModelConfig`` of ``kind`` (``moe`` or ``dense``); the dense FFN is topk x moe_ffn wide."""
    from megatron_rl.config import ModelConfig

    common = dict(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=max_len, attention_backend="local")  # fmt: skip
    if kind == "dense":
        return ModelConfig(**common, ffn_hidden_size=shape.topk * shape.moe_ffn)
    return ModelConfig(**common, ffn_hidden_size=shape.topk * shape.moe_ffn, num_moe_experts=shape.experts,
                       moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn, moe_aux_loss_coeff=1e-2,
                       moe_z_loss_coeff=1e-3)  # fmt: skip


def active_parameters(model_cfg, total: int) -> int:
    """Parameters one token passes through: all of them for a dense model; an MoE model's experts count topk
    times one expert (its router counts in full)."""
    if model_cfg.num_moe_experts is None:
        return total
    one_expert = 3 * model_cfg.hidden_size * model_cfg.moe_ffn_hidden_size
    return total - model_cfg.num_layers * (model_cfg.num_moe_experts - model_cfg.moe_router_topk) * one_expert


def summed_loss(logprobs, entropy, mb, loss_config):
    """``-sum(logprob * loss_mask)`` over the response tokens (the policy rescales it for micro-batches and DP)."""
    from megatron_rl.metrics import Metric

    loss = -(logprobs * mb["loss_mask"]).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum")}


class Memory:
    """Resident memory of this process (CPU) or CUDA memory (GPU), in MiB (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / 2**20
        release_heap()
        return status_kib("VmRSS") / 1024

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else status_kib("VmHWM") / 1024


def _rank(rank: int, world_size: int, port: int, ep: int, args: argparse.Namespace, queue) -> None:
    """One rank of a layout: both models side by side; puts ``(rank, result)`` (or ``(rank, traceback)``)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(args.threads)
    try:
        queue.put((rank, _measure(ep, args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, traceback.format_exc()))


def _measure(ep: int, args: argparse.Namespace) -> dict:
    from megatron_rl.config import BatchConfig, MegatronRLConfig, OptimizerConfig, ParallelConfig
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    shape, max_len = Shape(args.layers, args.hidden, args.experts, args.topk, args.moe_ffn), 2 * args.length
    out = independent_workload(IndependentSpec(num_sequences=args.sequences, mean_len=args.length,
                                               jitter=args.length // 8, vocab_size=VOCAB))  # fmt: skip
    batch = TrainingBatch.from_generator_output(out, pad_token_id=0)
    tokens = sum(len(p) + len(r) for p, r in zip(out["prompt_token_ids"], out["response_ids"]))
    configs = {kind: MegatronRLConfig(
        parallel=ParallelConfig(expert_model_parallel_size=ep if kind == "moe" else 1, device=args.device),
        model=model_config(shape, kind, max_len),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0),
        batch=BatchConfig(train_batch_size=args.sequences, policy_mini_batch_size=args.sequences,
                          micro_batch_size=None, max_tokens_per_micro_batch=tokens),
        seed=3,
    ) for kind in MODELS}  # fmt: skip
    groups = initialize_distributed(configs["moe"].parallel, seed=3)  # EP groups exist; the dense model ignores them
    memory = Memory(groups.device)
    policies, result = {}, {"world_size": groups.world_size, "tokens": tokens}
    for kind in MODELS:
        policies[kind] = MegatronPolicy(configs[kind], groups)
        _step(policies[kind], batch)  # warm-up; allocates Adam's state
        total = sum(v.numel() for v in policies[kind].full_state_dict().values())
        result[kind] = {"state_mib": state_mib(policies[kind]), "params": total, "times": [], "losses": [],
                        "active": active_parameters(configs[kind].model, total)}  # fmt: skip
    for rep in range(args.reps):
        for kind in (MODELS if rep % 2 == 0 else MODELS[::-1]):
            start = time.perf_counter()
            loss = _step(policies[kind], batch)
            result[kind]["times"].append(time.perf_counter() - start)
            result[kind]["losses"].append(loss)
    for kind in MODELS:
        before = memory.now()
        memory.reset_peak()
        _step(policies[kind], batch)
        result[kind]["step_peak_mib"] = memory.peak() - before
    destroy_distributed()
    return result


def state_mib(policy) -> float:
    """MiB of the tensors ``policy`` keeps between steps on this rank: parameters, their gradient buffers
    (``main_grad``), the optimizer's state; each storage once (views of one buffer share it)."""
    from megatron_rl.checkpoint.optimizer_state import sub_optimizers

    storages: dict[int, int] = {}
    tensors = [t for p in policy.module.parameters() for t in (p, getattr(p, "main_grad", None))]
    tensors += [v for sub in sub_optimizers(policy.optimizer) for state in sub.optimizer.state.values()
                for v in state.values()]  # fmt: skip
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def _step(policy, batch) -> float:
    """forward_backward + optim_step; returns the loss (synchronized on a GPU so the time is the step's)."""
    loss = policy.forward_backward(batch, summed_loss, None)["loss"].final()
    policy.optim_step()
    if policy.groups.device.type == "cuda":
        torch.cuda.synchronize()
    return loss


def run_layout(world_size: int, ep: int, args: argparse.Namespace) -> list[dict]:
    """Spawn ``world_size`` ranks (a free localhost port); their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, ep, args, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=args.timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    for rank, value in results.items():
        check(isinstance(value, dict), f"rank {rank} of the {world_size}-rank layout failed:\n{value}")
    return [results[r] for r in range(world_size)]


def layout_rows(name: str, ranks: list[dict], router: int) -> list[list[object]]:
    """Table rows of one layout (slowest rank's time per repetition, largest rank's memory); sanity checks
    (``router``: the routers' parameters, the only active ones the dense model lacks)."""
    rows = []
    for kind in MODELS:
        per_rank = [r[kind] for r in ranks]
        for r in per_rank:
            check(all(map(math.isfinite, r["losses"])), f"{name} {kind}: loss not finite")
        check(all(r["losses"] == per_rank[0]["losses"] for r in per_rank), f"{name} {kind}: ranks disagree on the loss")
        times = [max(step) for step in zip(*(r["times"] for r in per_rank))]
        info = per_rank[0]
        rows.append([name, kind, f"{info['params']:,}", f"{info['active']:,}", f"{statistics.median(times):.3f}",
                     f"{min(times):.3f}", f"{max(r['state_mib'] for r in per_rank):.1f}",
                     f"{max(r['step_peak_mib'] for r in per_rank):.0f}"])  # fmt: skip
    moe, dense = ranks[0]["moe"], ranks[0]["dense"]
    check(moe["active"] - dense["active"] == router, f"active parameters per token: moe {moe['active']} vs dense "
          f"{dense['active']}, expected to differ by the routers' {router}")
    check(moe["params"] > dense["params"], "the MoE model must have more parameters in total")
    return rows


def run(args: argparse.Namespace) -> dict:
    layouts = {"1 rank": run_layout(1, 1, args)}
    if args.ep2:
        layouts["2 ranks (MoE EP2, dense DP2)"] = run_layout(2, 2, args)
    router = args.layers * args.hidden * args.experts
    rows = [row for name, ranks in layouts.items() for row in layout_rows(name, ranks, router)]
    shape = (f"{args.layers} layers, hidden {args.hidden}, vocab {VOCAB}; MoE {args.experts} experts x SwiGLU "
             f"{args.moe_ffn}, top-{args.topk}; dense SwiGLU {args.topk * args.moe_ffn}; {args.sequences} sequences, "
             f"{layouts['1 rank'][0]['tokens']} tokens per step, {args.reps} timed steps per model, {args.threads} "
             f"torch thread(s) per rank, device {args.device}")  # fmt: skip
    header = ["layout", "model", "params", "active params / token", "step s (median)", "step s (min)",
              "state MiB", "step peak MiB"]  # fmt: skip
    return {"layouts": layouts, "report": shape + "\n\n" + markdown_table(header, rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="mean tokens per sequence (prompt + response)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per model (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (shared 2-core machine)")
    parser.add_argument("--ep2", action="store_true", help="also 2 ranks: MoE at EP2, dense at DP2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition (the smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.length, args.hidden, args.moe_ffn, args.experts, args.reps = 4, 64, 64, 32, 4, 1
    result = print_report_or_exit(lambda: run(args))
    if args.json:
        from megatron_rl.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(result["layouts"], indent=1))


if __name__ == "__main__":
    sys.exit(main())
