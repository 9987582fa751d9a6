"""Weight sync into the vLLM engine on CPU: sync seconds and effective MB/s against model size, bucket size and
layout (TP1, TP2, PP2) and the number of engines in the fleet, beside the disk round trip and the transport's
raw broadcast bandwidth of the same run.

    MEGATRON_RL_ENGINE_PYTHON=.venv-engine/bin/python .venv/bin/python bench/bench_weight_sync.py \
        [--models tiny mid 0.6b] [--layouts tp1 tp2 pp2] [--buckets 16 64 256] [--engines 1 2] [--repeats 3] \
        [--small]

Place in the data flow: ``VLLMEngine.update_weights`` (``megatron_rl/inference/``) after the optimizer step:
every trainer rank converts its stage's weights to HF names (TP-gathered one tensor at a time, mbridge), the
sender of each stage packs them into buckets and broadcasts them over a raw gloo group to each engine's worker
in turn (``rollout.num_engines`` servers, ``--engines``), which feeds them to vLLM's in-place ``reload_weights``.
The disk transport instead exports safetensors under /dev/shm once and has every engine ``reload_weights
(weights_path)`` them (``/collective_rpc`` ``megatron_rl_reload_path``, all engines at once).

Models: random-weight Qwen3 HF folders made locally with ``AutoModelForCausalLM.from_config`` (no downloads),
bf16 (trainer and engine; the real Qwen3-0.6B is bf16): ``tiny`` (the engine tests' 2 layers, hidden 64),
``mid`` (~100M), ``0.6b`` (the Qwen3-0.6B shape: hidden 1024, 28 layers, ffn 3072, 16 heads, 8 KV heads,
head_dim 128, vocab 151936, tied embeddings). The trainer side is a frozen ``MegatronPolicy``
(role='reference': no optimizer state; the sync reads the same parameters as a trainable policy's).

Per (model, layout, engines) a fresh group of ranks (spawned, one torch thread each) starts the fleet, then runs
``1 + --repeats`` rounds; a round = one sync per variant (each bucket size over gloo, then
``weight_transport=disk``), the order rotated every round so that the load of a shared machine spreads over
all variants. Round 0 is the warm-up (reported separately as ``first_s``, not in the median); "sync s" is the
median of the other rounds. Right before each gloo sync, the raw bandwidth of that bucket size
(``engine.raw_bandwidth(bucket)``: 3 plain gloo broadcasts of one bucket from sender 0 to the engine; median
over the rounds). Effective MB/s = bytes of HF tensors the engine received /
seconds of ``update_weights`` (conversion, TP gather, transfer, store round trips and the engine's reload
included). Memory: a thread samples VmRSS every ~2 ms on each rank during ``update_weights``; "peak extra" is
the peak minus the RSS just before (after ``malloc_trim``), compared with bucket + largest HF tensor (a
sampler can miss a spike shorter than its period: a lower bound). Where the time goes: the conversion alone
(``iter_stage_hf_weights`` run to the end, nothing sent), the sender's time blocked in broadcasts, the
engine's own receive+reload time (the slowest engine), the disk path's reload call (each engine's
``/collective_rpc`` round trip, timed around ``EngineServer.collective_rpc`` on rank 0: the slowest engine), one
store round trip.

Sanity checks (non-zero exit): every engine receives the same bytes and tensors every sync, a generation after
the syncs succeeds, and the bytes equal the conversion's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from procmem import release_heap, status_kib

MIB = 2**20
MODELS = {
    # name: Qwen3 config kwargs
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=False),
    "mid": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


class SanityCheckFailed(RuntimeError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SanityCheckFailed(message)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------ HF models
def _write_model(path: str, name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=0,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **MODELS[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)


def hf_model(root: Path, name: str) -> Path:
    """The random HF folder of ``name`` (made once, in a child process so its memory goes back)."""
    path = root / name
    if not (path / "done").exists():
        proc = mp.get_context("spawn").Process(target=_write_model, args=(str(path), name))
        proc.start()
        proc.join()
        check(proc.exitcode == 0, f"writing the {name} HF model failed (exit code {proc.exitcode})")
        (path / "done").write_text("")
    return path


# ------------------------------------------------------------------------------------------------ ranks
class RssSampler:
    """Peak VmRSS (KiB) of this process, sampled in a thread while active."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, status_kib("VmRSS"))
            time.sleep(self.period_s)

    def __enter__(self) -> "RssSampler":
        self.peak = status_kib("VmRSS")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, status_kib("VmRSS"))


def _timed_sync(engine, policy, groups, rpcs: list | None = None) -> dict:
    """One ``update_weights`` on every rank: seconds, this rank's peak extra RSS, time blocked in broadcasts;
    rank 0: every engine's statistics (``rpcs``: the ``_time_rpcs`` record, emptied here)."""
    import torch.distributed as dist
    from megatron_rl.inference.vllm import weight_sync

    release_heap()
    dist.barrier()
    weight_sync._bench_broadcast_s = 0.0
    if rpcs is not None:
        rpcs.clear()
    before = status_kib("VmRSS")
    with RssSampler() as sampler:
        seconds = engine.update_weights(policy)
    out = {"s": seconds, "peak_extra_mib": (sampler.peak - before) / 1024,
           "broadcast_s": weight_sync._bench_broadcast_s}
    if groups.rank == 0 and engine.transport != "disk":
        out["sender"] = dict(engine.last_stats["sender"])
        # every engine's worker stats (engine.last_stats has the first engine's only)
        per_engine = sorted((i, r[0]) for i, method, _s, r in rpcs if method == "megatron_rl_receive")
        check(len(per_engine) == len(engine.fleet.slots), f"{len(per_engine)} engines received weights, "
              f"{len(engine.fleet.slots)} serve")
        out["engines"] = [dict(stats) for _, stats in per_engine]
        out["engine"] = max(out["engines"], key=lambda e: e["seconds"])  # the slowest engine
    if groups.rank == 0:
        out["reset_s"] = max((s for _i, what, s, _r in rpcs if what == "/reset_prefix_cache"), default=0.0)
    if groups.rank == 0 and engine.transport == "disk":
        out["reload_s"] = [s for _i, method, s, _r in sorted(rpcs, key=lambda call: call[0])
                           if method == "megatron_rl_reload_path"]  # one per engine, in engine order
        check(len(out["reload_s"]) == len(engine.fleet.slots), "not every engine reloaded from disk")
    return out


def _time_rpcs(engine) -> list:
    """Rank 0: time every engine's ``collective_rpc`` and plain ``call`` (``/reset_prefix_cache`` after a sync; the
    fleet calls the engines concurrently); returns the record, (engine index, method or path, seconds, result)."""
    record: list = []
    for slot in engine.fleet.slots:
        real = slot.server.collective_rpc

        def timed(method, *args, _real=real, _index=slot.index, **kwargs):
            started = time.perf_counter()
            result = _real(method, *args, **kwargs)
            record.append((_index, method, time.perf_counter() - started, result))
            return result

        slot.server.collective_rpc = timed
        real_call = slot.server.call

        def timed_call(method, path, *args, _real=real_call, _index=slot.index, **kwargs):
            started = time.perf_counter()
            result = _real(method, path, *args, **kwargs)
            record.append((_index, path, time.perf_counter() - started, result))
            return result

        slot.server.call = timed_call
    return record


def _convert_only(policy, hf_source: str, groups) -> dict:
    """The conversion alone (TP gather + mbridge to HF), nothing sent: seconds, bytes, largest tensor."""
    from megatron_rl.hf.weights import iter_stage_hf_weights

    release_heap()
    started = time.perf_counter()
    nbytes = largest = count = 0
    for _name, tensor in iter_stage_hf_weights([policy.module], hf_source, groups):
        size = tensor.numel() * tensor.element_size()
        nbytes, largest, count = nbytes + size, max(largest, size), count + 1
    return {"s": time.perf_counter() - started, "bytes": nbytes, "largest": largest, "tensors": count}


def _rank(rank: int, world: int, port: int, point: dict, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    torch.set_num_threads(1)
    try:
        queue.put((rank, _measure(rank, world, point)))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, {"error": f"{err!r}\n{traceback.format_exc()}"}))


def _measure(rank: int, world: int, point: dict) -> dict:
    import torch.distributed as dist
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.hf import policy_from_hf
    from megatron_rl.inference.vllm import weight_sync
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.engine import VLLMEngine

    real_broadcast = weight_sync.broadcast

    def timed_broadcast(group, tensor):  # the sender's time blocked in broadcasts (bench-only wrapper)
        started = time.perf_counter()
        real_broadcast(group, tensor)
        weight_sync._bench_broadcast_s += time.perf_counter() - started

    weight_sync.broadcast = timed_broadcast
    weight_sync._bench_broadcast_s = 0.0

    tp, pp = point["tp"], point["pp"]
    device = point.get("device", "cpu")
    cfg = load_config(None, [f"parallel.device={device}", f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}", "model.params_dtype=bfloat16",
                             "model.attention_backend=local"], world_size=world)  # fmt: skip
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    started = time.perf_counter()
    policy = policy_from_hf(cfg, groups, role="reference", hf_dir=point["hf_dir"], pad_token_id=0)
    load_s = time.perf_counter() - started
    buckets = point["buckets"]
    rollout = RolloutConfig(engine="vllm", bucket_mb=buckets[0], max_model_len=256, kv_cache_gib=1.0,
                            start_timeout_s=1200, num_engines=point["engines"])
    started = time.perf_counter()
    engine = VLLMEngine.start(policy, rollout, hf_dir=point["hf_dir"], work_dir=point["work_dir"])
    start_s = time.perf_counter() - started
    out: dict = {"rank": rank, "load_s": load_s, "engine_start_s": start_s,
                 "rss_mib": status_kib("VmRSS") / 1024}  # fmt: skip
    try:
        out["convert"] = [_convert_only(policy, engine.hf_source, groups) for _ in range(2)][-1]
        if rank == 0:
            rtts = []
            for i in range(20):
                t = time.perf_counter()
                engine.sender.store.set(f"bench/rtt{i}", "x" * 512)
                rtts.append(time.perf_counter() - t)
            out["store_set_ms"] = statistics.median(rtts) * 1e3
        rpcs = _time_rpcs(engine) if rank == 0 else None
        variants = [*buckets, "disk"]
        out["buckets"] = {mib: {"raw_bytes_s": [], "syncs": []} for mib in buckets}
        out["disk"] = {"syncs": []}
        for round_ in range(1 + point["repeats"]):  # round 0 = warm-up; order rotated every round
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant == "disk":
                    engine.transport = "disk"
                    out["disk"]["syncs"].append(_timed_sync(engine, policy, groups, rpcs))
                    continue
                engine.transport = "gloo"
                engine.sender.bucket_bytes = int(variant * MIB)
                dist.barrier()
                if rank == 0:
                    out["buckets"][variant]["raw_bytes_s"].append(engine.raw_bandwidth(int(variant * MIB)))
                dist.barrier()
                out["buckets"][variant]["syncs"].append(_timed_sync(engine, policy, groups, rpcs))
        prompts = [[5 + i, 6, 7] for i in range(2 * point["engines"])]  # distinct groups: every engine serves one
        completions = engine.generate(prompts, SamplingSpec(max_tokens=2, stop_token_ids=(2,)), seed=0)
        out["generated"] = min(len(c.token_ids) for c in completions)
    finally:
        engine.close()
        destroy_distributed()
    return out


def run_point(model: str, layout: str, hf_dir: Path, work_root: Path, buckets: list[float], repeats: int,
              timeout: float, engines: int = 1, device: str = "cpu") -> dict:
    """One (model, layout, engines) on fresh ranks with a fleet of ``engines``: every bucket size, then the disk
    transport."""
    tp, pp = LAYOUTS[layout]
    world = tp * pp
    point = {"tp": tp, "pp": pp, "hf_dir": str(hf_dir), "work_dir": str(work_root / f"{model}_{layout}_e{engines}"),
             "buckets": buckets, "repeats": repeats, "engines": engines, "device": device}  # fmt: skip
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_rank, args=(r, world, port, point, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world:
            left = deadline - time.monotonic()
            check(left > 0, f"{model} {layout} e{engines}: no result within {timeout:.0f} s")
            try:
                rank, res = queue.get(timeout=min(left, 5))
            except Exception:  # noqa: BLE001 - queue.Empty: look for a dead rank
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                check(not dead, f"{model} {layout} e{engines}: a rank died (exit codes {dead}; out of memory?)")
                continue
            results[rank] = res
            if "error" in res:
                break
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(results) == world else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [res["error"] for res in results.values() if "error" in res]
    check(not errors, f"{model} {layout} e{engines}: {errors}")
    return summarize(model, layout, buckets, [results[r] for r in range(world)], engines)


def summarize(model: str, layout: str, buckets: list[float], ranks: list[dict], engines: int = 1) -> dict:
    r0 = ranks[0]
    convert_bytes = sum(r["convert"]["bytes"] for r in ranks if r["rank"] in _senders(layout, len(ranks)))
    largest = max(r["convert"]["largest"] for r in ranks)
    row = {"model": model, "layout": layout, "engines": engines, "ranks": len(ranks), "hf_bytes": convert_bytes,
           "largest_tensor_bytes": largest, "engine_start_s": r0["engine_start_s"],
           "convert_s": max(r["convert"]["s"] for r in ranks), "store_set_ms": r0["store_set_ms"],
           "rank_rss_mib": [round(r["rss_mib"]) for r in ranks], "buckets": []}  # fmt: skip
    for mib in buckets:
        per_rank = [r["buckets"][mib]["syncs"] for r in ranks]
        timed0 = per_rank[0][1:]
        received = {(e["bytes"], e["tensors"]) for s in per_rank[0] for e in s["engines"]}
        check(len(received) == 1, f"{model} {layout} e{engines} bucket {mib}: the engines received {received}")
        nbytes, tensors = received.pop()
        check(nbytes == convert_bytes,
              f"{model} {layout} e{engines}: engine got {nbytes} bytes, conversion gave {convert_bytes}")
        sync_s = statistics.median(s["s"] for s in timed0)
        raws = r0["buckets"][mib]["raw_bytes_s"]
        raw = statistics.median(raws)
        peak = max(max(s["peak_extra_mib"] for s in syncs[1:]) for syncs in per_rank)
        bound = (mib * MIB + largest) / MIB
        row["buckets"].append({
            "bucket_mib": mib, "first_s": per_rank[0][0]["s"], "sync_s": sync_s, "syncs_s": [s["s"] for s in timed0],
            "min_s": min(s["s"] for s in timed0), "mb_s": nbytes / sync_s / 1e6, "raw_mb_s": raw / 1e6,
            "raw_mb_s_all": [r / 1e6 for r in raws], "ratio_to_raw": nbytes / sync_s / raw,
            "tensors": tensors, "engine_buckets": timed0[-1]["engine"]["buckets"],
            "engine_s": statistics.median(s["engine"]["seconds"] for s in timed0),
            "engine_s_each": [statistics.median(s["engines"][e]["seconds"] for s in timed0) for e in range(engines)],
            "sender_s": statistics.median(s["sender"]["seconds"] for s in timed0),
            "sender_broadcast_s": statistics.median(s["broadcast_s"] for s in timed0),
            "reset_prefix_cache_s": statistics.median(s["reset_s"] for s in timed0),
            "peak_extra_mib": peak, "peak_extra_per_rank_mib": [max(s["peak_extra_mib"] for s in syncs[1:])
                                                                for syncs in per_rank],
            "bucket_plus_largest_mib": bound, "memory_ok": peak <= bound,
        })  # fmt: skip
    disk = [r["disk"]["syncs"] for r in ranks]
    disk_s = statistics.median(s["s"] for s in disk[0][1:])
    row["disk"] = {"first_s": disk[0][0]["s"], "sync_s": disk_s, "syncs_s": [s["s"] for s in disk[0][1:]],
                   "min_s": min(s["s"] for s in disk[0][1:]), "mb_s": convert_bytes / disk_s / 1e6,
                   "reload_s": statistics.median(max(s["reload_s"]) for s in disk[0][1:]),
                   "reload_s_each": [statistics.median(s["reload_s"][e] for s in disk[0][1:]) for e in range(engines)],
                   "reset_prefix_cache_s": statistics.median(s["reset_s"] for s in disk[0][1:]),
                   "peak_extra_mib": max(max(s["peak_extra_mib"] for s in syncs[1:]) for syncs in disk)}  # fmt: skip
    check(all(r["generated"] >= 1 for r in ranks), f"{model} {layout} e{engines}: no tokens generated after the syncs")
    return row


def _senders(layout: str, world: int) -> set[int]:
    tp, pp = LAYOUTS[layout]
    return {stage * tp for stage in range(pp)}  # megatron's rank order: TP fastest


def table(rows: list[dict]) -> str:
    head = ["model", "layout", "engines", "HF MB", "bucket MiB", "sync s (median; first)", "MB/s", "raw MB/s",
            "sync/raw", "engine s", "sender bcast s", "reset s", "convert s", "peak extra MiB", "bucket+largest MiB",
            "disk s", "disk MB/s", "disk reload s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['layout']} | {row.get('engines', 1)} | "
                         + " | ".join(["-"] * (len(head) - 4))
                         + f" | failed: {row['error'][:80]} |")
            continue
        for b in row["buckets"]:
            lines.append("| " + " | ".join([
                row["model"], row["layout"], str(row["engines"]), f"{row['hf_bytes'] / 1e6:.1f}",
                f"{b['bucket_mib']:g}",
                f"{b['sync_s']:.3f}; {b['first_s']:.3f}", f"{b['mb_s']:.0f}", f"{b['raw_mb_s']:.0f}",
                f"{b['ratio_to_raw']:.2f}", f"{b['engine_s']:.3f}", f"{b['sender_broadcast_s']:.3f}",
                f"{b['reset_prefix_cache_s']:.3f}",
                f"{row['convert_s']:.3f}", f"{b['peak_extra_mib']:.0f}", f"{b['bucket_plus_largest_mib']:.0f}",
                f"{row['disk']['sync_s']:.3f}", f"{row['disk']['mb_s']:.0f}", f"{row['disk']['reload_s']:.3f}",
            ]) + " |")  # fmt: skip
    return "\n".join(lines)


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--buckets", type=float, nargs="+", default=[16, 64, 256], help="bucket sizes, MiB")
    parser.add_argument("--engines", type=int, nargs="+", default=[1],
                        help="rollout.num_engines: a fresh fleet of each size, side by side in one run")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs after the warm-up one (median)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="the trainer ranks' device (cuda: one GPU per rank, NCCL transport; not measured yet)")
    parser.add_argument("--small", action="store_true", help="tiny model, TP1, bucket 1 MiB, 1 repeat (~1 min)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/megatron_rl_bench_models"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/megatron_rl_bench_weight_sync"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (model, layout)")
    parser.add_argument("--keep-going", action="store_true", help="record a failed point and go on")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default bench/results/weight_sync.json; none with --small)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up (ranks, engines) on a kill
    if args.small:
        args.models, args.layouts, args.buckets, args.repeats, args.engines = ["tiny"], ["tp1"], [1.0], 1, [1]
    out = args.out or (None if args.small else Path(__file__).resolve().parent / "results" / "weight_sync.json")
    rows: list[dict] = []
    meta = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "shared": True,
                        "torch": torch.__version__},
            "commit": _git_commit(), "dtype": "bfloat16", "repeats": args.repeats, "engines": args.engines,
            "device": args.device,
            "notes": "sync_s = median of the timed syncs; first_s = the warm-up sync, not in the median"}  # fmt: skip
    try:
        for model in args.models:
            hf_dir = hf_model(args.model_dir, model)
            for layout in args.layouts:
                for engines in args.engines:
                    try:
                        row = run_point(model, layout, hf_dir, args.work_dir, args.buckets, args.repeats,
                                        args.timeout, engines, args.device)
                    except SanityCheckFailed as err:
                        if not args.keep_going:
                            raise
                        row = {"model": model, "layout": layout, "engines": engines, "error": str(err)[-2000:]}
                    row["load_avg"] = os.getloadavg()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if out is not None:
                        meta["load_avg_end"] = os.getloadavg()
                        write_json(out, {"meta": meta, "rows": rows})
    except SanityCheckFailed as err:
        print(f"SANITY CHECK FAILED: {err}", file=sys.stderr)
        sys.exit(1)
    print(table(rows))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
