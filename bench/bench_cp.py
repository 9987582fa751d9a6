"""Context parallelism on CPU: per-rank peak step memory and step time against sequence length, CP1/CP2/CP4.

    .venv/bin/python bench/bench_cp.py [--lengths 2048 4096 8192 16384 32768] [--cps 1 2 4] [--quick]

Place in the data flow (docs/DESIGN.md section 14): the whole ``MegatronPolicy.forward_backward`` path (host
planning and ``split_for_cp``, megatron-core's schedule, the CP attention, the output gather, the loss), no
optimizer step. One packed sequence of L tokens (a long merged trajectory: prompt L - 64, response 64, loss on
the response) per step, tiny model (2 layers, hidden 64, 4 heads / 2 KV groups, vocab 128, fp32).

For each (cp, L) a fresh group of ``cp`` gloo ranks (spawned processes, one torch thread each) builds the
policy, runs one warm-up step, releases freed heap (``malloc_trim``), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs`` = 5) and runs one step: "peak MiB" is ``VmHWM - VmRSS`` before that step on each
rank (activations, autograd state, temporaries; weights, grad buffers and imports are already resident), the
table gives the largest rank. "step s" is the slower rank's wall time of the faster of two measured steps.
CP4 runs 4 processes on this machine's 2 cores, so its step time is inflated by ~2x by oversubscription.

Sanity checks (non-zero exit): every rank of a run reports the same loss, and a run's loss equals the CP1
loss at the same L (relative 1e-4: the same model and tokens; fp32 summation order only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from procmem import release_heap, status_kib

RESPONSE = 64


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(cp: int, length: int):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    config = MegatronRLConfig(
        parallel=ParallelConfig(context_parallel_size=cp, device="cpu"),
        model=ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, vocab_size=128, max_position_embeddings=length,
                          attention_backend="local"),  # fmt: skip
        optimizer=OptimizerConfig(optimizer="sgd", lr=1e-3),
        seed=7,
    )
    config.batch.micro_batch_size = 1
    return config


def _batch(length: int):
    from megatron_rl.data.batch import TrainingBatch

    g = torch.Generator().manual_seed(length)
    tensors = {
        "sequences": torch.randint(1, 128, (1, length), generator=g),
        "attention_mask": torch.ones(1, length, dtype=torch.long),
        "response_mask": torch.ones(1, RESPONSE, dtype=torch.long),
        "loss_mask": torch.ones(1, RESPONSE),
        "advantages": torch.randn(1, RESPONSE, generator=g),
    }
    return TrainingBatch(tensors, [0], [0], [True])


def _loss(logprobs, entropy, mb, loss_config):
    from megatron_rl.metrics import Metric

    loss = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum")}


def _step(policy, batch) -> tuple[float, float]:
    start = time.perf_counter()
    metrics = policy.forward_backward(batch, _loss, None)
    elapsed = time.perf_counter() - start
    policy.zero_grad()
    return elapsed, metrics["loss"].final()


def _rank(rank: int, world: int, port: int, length: int, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    torch.set_num_threads(1)
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    try:
        config = _config(world, length)
        groups = initialize_distributed(config.parallel, config.seed)
        policy, batch = MegatronPolicy(config, groups), _batch(length)
        _step(policy, batch)  # warm-up: grad buffers, caches
        release_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        baseline = status_kib("VmRSS")
        first, loss = _step(policy, batch)
        peak = (status_kib("VmHWM") - baseline) / 1024
        second, _ = _step(policy, batch)
        queue.put((rank, {"peak_mib": peak, "step_s": min(first, second), "loss": loss}))
        destroy_distributed()
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": repr(err)}))


def run_point(cp: int, length: int, timeout: float = 900) -> dict:
    """One (cp, L) point on ``cp`` fresh ranks: the largest per-rank peak, the slowest rank's step time."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_rank, args=(r, cp, port, length, queue)) for r in range(cp)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    errors = [res["error"] for res in results.values() if "error" in res]
    check(not errors, f"cp={cp} L={length}: {errors}")
    losses = [res["loss"] for res in results.values()]
    check(max(losses) == min(losses), f"cp={cp} L={length}: ranks disagree on the loss {losses}")
    return {"cp": cp, "length": length, "peak_mib": max(r["peak_mib"] for r in results.values()),
            "step_s": max(r["step_s"] for r in results.values()), "loss": losses[0]}  # fmt: skip


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"bench_cp sanity check failed: {message}")


def table(points: list[dict], cps: list[int], lengths: list[int]) -> str:
    by = {(p["cp"], p["length"]): p for p in points}
    head = ["L tokens"] + [f"CP{c} peak MiB" for c in cps] + [f"CP{c} step s" for c in cps]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in lengths:
        mem = [f"{by[c, length]['peak_mib']:.0f}" if (c, length) in by else "-" for c in cps]
        sec = [f"{by[c, length]['step_s']:.2f}" if (c, length) in by else "-" for c in cps]
        rows.append("| " + " | ".join([str(length), *mem, *sec]) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="L = 256, 512 at CP1, CP2 (seconds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cp.json")
    args = parser.parse_args()
    lengths, cps = ([256, 512], [1, 2]) if args.quick else (args.lengths, args.cps)
    points = []
    for length in lengths:
        for cp in cps:
            point = run_point(cp, length)
            points.append(point)
            print(json.dumps(point), flush=True)
        reference = next(p["loss"] for p in points if p["length"] == length and p["cp"] == cps[0])
        for p in points:
            if p["length"] == length:
                check(abs(p["loss"] - reference) <= 1e-4 * max(1.0, abs(reference)),
                      f"L={length}: CP{p['cp']} loss {p['loss']} != CP{cps[0]} loss {reference}")
    print(table(points, cps, lengths))
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(points, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
