"""The rollout fleet on this machine: generation tokens/s with 1 and 2 ``vllm serve`` engines side by side in one
run, and what the router adds to a request's latency.

    MEGATRON_RL_ENGINE_PYTHON=.venv-engine/bin/python .venv/bin/python bench/bench_fleet.py \\
        [--models tiny mid 0.6b] [--engines 1 2] [--prompts 64] [--tokens 32 256] [--repeats 3] [--small] \
        [--dtype float32] [--engine-tp 1] [--gpu-memory-utilization 0.4]

Place in the data flow: ``VLLMEngine.generate`` on trainer rank 0 is ``Fleet.generate`` (``inference/vllm/calls.py``):
``router.route`` assigns each prompt's group to an engine (least work first), then one token-in
``POST /v1/completions`` per group goes to its engine (``EngineServer.sample``, ``n`` samples with seeds
``s, s + 1, ...``; a thread per request, 64 per engine at most). This benchmark drives exactly that ``Fleet`` (no trainer, no weight
sync: the engines serve the HF folder they started on, so every slot is put in service directly).

Throughput: per fleet size N (``--engines``; a fresh fleet each, ``rollout.num_engines=N``, the cores split
between the engines as the job does: ``VLLM_CPU_OMP_THREADS_BIND``), ``--prompts`` distinct prompts of 16 random
tokens (distinct groups, so the router splits them evenly), ``ignore_eos`` so every response is exactly
``max_tokens`` long, temperature 1, seeded like the job (``seed * 1_000_003 + i``). tokens/s = generated tokens /
wall seconds of ``Fleet.generate`` (routing, HTTP, prefill and decode included). In a fleet of N > 1 the same
workloads also run with only engine 0 serving ("1 of N"): the second server is up but idle, which separates the
cost of its mere presence from that of splitting the work. One warm-up call per (variant, workload), then
``--repeats`` rounds, each round every variant and workload in turn (a shared machine's load spreads over all);
the table gives the median (min-max).

Latency (the first fleet, engine 0, one request at a time, ``max_tokens=1``, the same 16-token prompt, a fresh
seed each): a raw ``http.client`` request with the body already encoded (a new connection each, like the fleet;
and over one kept-alive connection), ``EngineServer.complete`` (JSON encode/decode, the Completion), and
``Fleet.generate`` of one prompt (+ ``route`` + the thread pool). The rounds interleave the four. Separately the
in-process cost of ``route`` per request (a batch of ``--prompts`` prompts, GRPO-like groups of 4, 16 and 1024
tokens each, over 2 engines; CPU time of the process, so a loaded machine does not inflate it).

Sanity checks (non-zero exit): every response has exactly ``max_tokens`` tokens and log-probs, every engine of a
fleet served requests, and the same seeded batch gives the same token ids on a fleet of 1 and of N (the sample
depends on the prompt's index, never on the engine; reported as the fraction of identical responses, checked
>= 0.9: fp32 engines in different batches can differ in the last bits of a logit).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

from bench_weight_sync import SanityCheckFailed, _git_commit, check, hf_model, write_json

PROMPT_LEN = 16


def make_prompts(n: int, vocab: int, seed: int, length: int = PROMPT_LEN, group: int = 1) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids, ``group`` consecutive copies of each (a GRPO group)."""
    rng = random.Random(seed)
    distinct = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(-(-n // group))]
    return [distinct[i // group] for i in range(n)]


def seeds_for(call_seed: int, n: int) -> list[int]:
    return [(call_seed * 1_000_003 + i) % (2**63) for i in range(n)]


def start_fleet(num_engines: int, model_dir: Path, work_dir: Path, max_model_len: int, *, dtype: str = "float32",
                engine_tp: int = 1, gpu_memory_utilization: float = 0.4):
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.vllm.server import ServeOptions
    from megatron_rl.inference.nodes import NodeLayout
    from megatron_rl.inference.vllm.fleet import Fleet
    from megatron_rl.inference.vllm.launcher import Launcher, engine_python, job_token

    config = RolloutConfig(engine="vllm", num_engines=num_engines, max_model_len=max_model_len, kv_cache_gib=1.0,
                           start_timeout_s=1200, request_timeout_s=600, engine_tensor_parallel_size=engine_tp,
                           gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip
    options = ServeOptions(python=engine_python(config), dtype=dtype, max_model_len=max_model_len, seed=0,
                           kv_cache_gib=1.0, gpu_memory_utilization=gpu_memory_utilization,
                           tensor_parallel_size=engine_tp)  # fmt: skip
    launcher = Launcher(options, model_dir, work_dir, job_token(config), num_engines, NodeLayout())
    fleet = Fleet(config, launcher)
    started = time.perf_counter()
    fleet.start()
    for slot in fleet.slots:  # no weight sync here: the engines serve the folder they started on
        slot.state = "serving"
    return fleet, time.perf_counter() - started


def _role(comm: str) -> str:
    if comm.startswith("VLLM::EngineCor"):
        return "engine core"
    if "Worker" in comm:
        return "worker"
    return "api server"


def fleet_cpu(fleet) -> dict[str, float]:
    """CPU seconds (user + system, /proc) so far of every process of the fleet's servers, by role (the API
    server, vLLM's engine core, its worker), and of this process (the client: request threads, route, JSON)."""
    tick = os.sysconf("SC_CLK_TCK")
    groups = {s.server.proc.pid for s in fleet.slots if s.server is not None and s.server.proc is not None}
    cpu = {"api server": 0.0, "engine core": 0.0, "worker": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[2]) in groups:  # field 5: the process group
            cpu[_role(comm)] += (int(rest[11]) + int(rest[12])) / tick  # fields 14, 15: utime, stime
    own = os.times()
    cpu["client"] = own.user + own.system
    return cpu


def timed_generate(fleet, prompts, max_tokens: int, call_seed: int, serving: list[int]) -> dict:
    """One ``Fleet.generate`` with only the slots in ``serving`` in service: seconds, tokens, completions."""
    from megatron_rl.inference.engine import SamplingSpec

    for slot in fleet.slots:
        slot.state = "serving" if slot.index in serving else "joining"
    spec = SamplingSpec(max_tokens=max_tokens, temperature=1.0)
    counts = {s.index: 0 for s in fleet.slots}
    real_sample = {s.index: s.server.sample for s in fleet.slots}
    for slot in fleet.slots:  # count the requests each engine served
        def counted(*args, _index=slot.index, **kwargs):
            counts[_index] += 1
            return real_sample[_index](*args, **kwargs)

        slot.server.sample = counted
    try:
        cpu_before = fleet_cpu(fleet)
        started = time.perf_counter()
        completions = fleet.generate(prompts, spec, seeds_for(call_seed, len(prompts)))
        seconds = time.perf_counter() - started
        cpu = {role: v - cpu_before[role] for role, v in fleet_cpu(fleet).items()}
    finally:
        for slot in fleet.slots:
            slot.server.sample = real_sample[slot.index]
            slot.state = "serving"
    check(completions is not None, "the fleet lost every engine during a call")
    check(all(len(c.token_ids) == max_tokens == len(c.logprobs) for c in completions),
          f"a response is not {max_tokens} tokens long")
    check(all(counts[i] > 0 for i in serving), f"an engine served no request: {counts}")
    counts = {i: counts[i] for i in serving}
    tokens = sum(len(c.token_ids) for c in completions)
    return {"s": seconds, "tokens": tokens, "tok_s": tokens / seconds, "per_engine": counts, "cpu_s": cpu,
            "ids": [c.token_ids for c in completions]}


def throughput(fleet, num_engines: int, workloads: list[int], prompts, repeats: int) -> dict:
    """tokens/s per (variant, max_tokens): all engines serving, and (N > 1) engine 0 alone."""
    variants = {f"{num_engines} engine{'s' if num_engines > 1 else ''}": list(range(num_engines))}
    if num_engines > 1:
        variants[f"1 of {num_engines} serving"] = [0]
    runs: dict = {(v, t): [] for v in variants for t in workloads}
    ids: dict = {}
    for round_ in range(1 + repeats):  # round 0 = warm-up
        for variant, serving in variants.items():
            for max_tokens in workloads:
                res = timed_generate(fleet, prompts, max_tokens, call_seed=1000 + max_tokens, serving=serving)
                ids.setdefault((variant, max_tokens), res.pop("ids"))
                if round_ > 0:
                    runs[(variant, max_tokens)].append(res)
                print(f"  {variant:>16} x{max_tokens:<4} round {round_}: {res['tok_s']:8.0f} tok/s "
                      f"({res['s']:.2f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    rows = []
    for (variant, max_tokens), rs in runs.items():
        tok_s = [r["tok_s"] for r in rs]
        rows.append({"variant": variant, "engines_serving": len(variants[variant]), "fleet": num_engines,
                     "prompts": len(prompts), "max_tokens": max_tokens, "tok_s": statistics.median(tok_s),
                     "tok_s_all": tok_s, "s": statistics.median(r["s"] for r in rs),
                     "per_engine": rs[-1]["per_engine"],
                     "cpu_ms_per_1k_tokens": {role: statistics.median(r["cpu_s"][role] / r["tokens"] * 1e6 for r in rs)
                                              for role in rs[0]["cpu_s"]},
                     "cores_busy": statistics.median(sum(r["cpu_s"].values()) / r["s"] for r in rs)})  # fmt: skip
    return {"rows": rows, "ids": ids}


# ------------------------------------------------------------------------------------------------ latency
def route_cost(num_prompts: int, lengths=(16, 1024), iters: int = 200) -> list[dict]:
    """In-process ``route`` CPU seconds per request: a batch of GRPO-like groups (4 samples) over 2 engines."""
    from megatron_rl.inference.vllm.router import route

    out = []
    for length in lengths:
        prompts = make_prompts(num_prompts, 30000, seed=7, length=length, group=4)
        route(prompts, [0, 1], max_tokens=256)
        times = []
        for _ in range(5):
            started = time.process_time()  # CPU time of this process: the machine's load does not inflate it
            for _ in range(iters):
                route(prompts, [0, 1], max_tokens=256)
            times.append((time.process_time() - started) / iters / num_prompts)
        out.append({"prompt_tokens": length, "batch": num_prompts, "us_per_request": statistics.median(times) * 1e6})
    return out


def request_latency(fleet, prompt: list[int], reps: int) -> dict:
    """Milliseconds per request (median, p90) through each path to engine 0 (module docstring)."""
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.server import MODEL_NAME

    slot = fleet.slots[0]
    for s in fleet.slots:
        s.state = "serving" if s is slot else "joining"
    server = slot.server
    spec = SamplingSpec(max_tokens=1, temperature=1.0)
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}

    def body(seed: int) -> bytes:
        return json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                           "seed": seed, "stop_token_ids": [], "ignore_eos": True, "logprobs": 0,
                           "return_token_ids": True, "return_tokens_as_token_ids": True,
                           "skip_special_tokens": False}).encode()  # fmt: skip

    keep = http.client.HTTPConnection(server.host, server.port, timeout=60)

    def raw_new(seed: int) -> float:
        data = body(seed)
        connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=data, headers=headers)
        response = connection.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - started
        connection.close()
        check(response.status == 200 and payload, f"raw request: HTTP {response.status}")
        return elapsed

    def raw_keepalive(seed: int) -> float:
        data = body(seed)
        started = time.perf_counter()
        keep.request("POST", "/v1/completions", body=data, headers=headers)
        response = keep.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - started
        check(response.status == 200 and payload, f"raw keep-alive request: HTTP {response.status}")
        return elapsed

    def via_server(seed: int) -> float:
        started = time.perf_counter()
        server.complete(prompt, spec, seed=seed, timeout_s=60)
        return time.perf_counter() - started

    def via_fleet(seed: int) -> float:
        started = time.perf_counter()
        fleet.generate([prompt], spec, [seed])
        return time.perf_counter() - started

    paths = {"raw http.client, new connection": raw_new, "raw http.client, keep-alive": raw_keepalive,
             "EngineServer.complete": via_server, "Fleet.generate (1 prompt)": via_fleet}  # fmt: skip
    times: dict = {name: [] for name in paths}
    try:
        for rep in range(reps + 3):  # 3 warm-up rounds
            for i, (name, fn) in enumerate(paths.items()):
                elapsed = fn(10_000 + rep * 10 + i)
                if rep >= 3:
                    times[name].append(elapsed * 1e3)
    finally:
        keep.close()
        for s in fleet.slots:
            s.state = "serving"
    out = {}
    for name, ms in times.items():
        ms = sorted(ms)
        out[name] = {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "n": len(ms)}
    return out


# ------------------------------------------------------------------------------------------------ run
MAX_MODEL_LEN = {"tiny": 1024, "mid": 1024, "0.6b": 2048}
VOCAB = {"tiny": 256, "mid": 32000, "0.6b": 151936}


def run_model(model: str, hf_dir: Path, work_root: Path, engines: list[int], num_prompts: int, workloads: list[int],
              repeats: int, latency_reps: int, **serve) -> dict:
    prompts = make_prompts(num_prompts, VOCAB[model], seed=0)
    result: dict = {"model": model, "throughput": [], "start_s": {}, "load_avg": {}}
    ids_by_fleet = {}
    for num_engines in engines:
        print(f"{model}: a fleet of {num_engines} (load {os.getloadavg()[0]:.1f})", flush=True)
        fleet, start_s = start_fleet(num_engines, hf_dir, work_root / f"{model}_e{num_engines}", MAX_MODEL_LEN[model],
                                     **serve)
        try:
            result["start_s"][num_engines] = start_s
            load_before = os.getloadavg()
            measured = throughput(fleet, num_engines, workloads, prompts, repeats)
            result["throughput"] += measured["rows"]
            ids_by_fleet[num_engines] = measured["ids"]
            if "latency" not in result:
                result["latency"] = request_latency(fleet, prompts[0], latency_reps)
                result["latency_fleet"] = num_engines
            result["load_avg"][num_engines] = [load_before, os.getloadavg()]
        finally:
            fleet.kill_all()
    # the same seeded batch gives the same samples whichever engine serves it
    base = ids_by_fleet[engines[0]]
    agree = {}
    for num_engines, ids in ids_by_fleet.items():
        for (variant, max_tokens), responses in ids.items():
            reference = base[next(k for k in base if k[1] == max_tokens)]
            agree[f"{variant} x{max_tokens}"] = sum(a == b for a, b in zip(responses, reference)) / len(responses)
    result["same_samples_fraction"] = agree
    check(all(f >= 0.9 for f in agree.values()), f"{model}: the same seeds gave other samples: {agree}")
    return result


def tables(results: list[dict]) -> str:
    roles = ("api server", "engine core", "worker", "client")
    lines = ["| model | fleet | serving | prompts x tokens | tok/s median (min-max) | s | requests per engine | CPU ms "
             "per 1k tokens: " + " / ".join(roles) + " | cores busy |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in sorted(res["throughput"], key=lambda r: (r["max_tokens"], r["fleet"], -r["engines_serving"])):
            lines.append(f"| {res['model']} | {r['fleet']} | {r['engines_serving']} | {r['prompts']} x "
                         f"{r['max_tokens']} | {r['tok_s']:.0f} ({min(r['tok_s_all']):.0f}-{max(r['tok_s_all']):.0f})"
                         f" | {r['s']:.2f} | {'/'.join(str(v) for v in r['per_engine'].values())} | "
                         + " / ".join(f"{r['cpu_ms_per_1k_tokens'][k]:.0f}" for k in roles)
                         + f" | {r['cores_busy']:.2f} |")
    lines += ["", "| model | path to engine 0 (1 request, max_tokens=1) | median ms | p90 ms | added vs raw (new "
              "connection), ms |", "|---|---|---|---|---|"]
    for res in results:
        base = res["latency"]["raw http.client, new connection"]["median_ms"]
        for name, v in res["latency"].items():
            lines.append(f"| {res['model']} | {name} | {v['median_ms']:.2f} | {v['p90_ms']:.2f} | "
                         f"{v['median_ms'] - base:+.2f} |")
    lines += ["", "| route() batch | prompt tokens | CPU us per request |", "|---|---|---|"]
    for r in results[0]["route"]:
        lines.append(f"| {r['batch']} (groups of 4, 2 engines) | {r['prompt_tokens']} | {r['us_per_request']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=list(MAX_MODEL_LEN))
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="fleet sizes (rollout.num_engines)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256], help="max_tokens per workload")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up one (median)")
    parser.add_argument("--latency-reps", type=int, default=30)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engines' dtype")
    parser.add_argument("--engine-tp", type=int, default=1, help="rollout.engine_tensor_parallel_size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine (GPU only)")
    parser.add_argument("--small", action="store_true",
                        help="tiny model, one fleet of 2 (so also '1 of 2 serving'), 8 prompts x 8 tokens, 1 round")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/megatron_rl_bench_models"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/megatron_rl_bench_fleet"))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default bench/results/fleet.json; none with --small)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up (fleet.kill_all) on a kill
    if args.small:
        args.models, args.engines, args.prompts, args.tokens = ["tiny"], [2], 8, [8]
        args.repeats, args.latency_reps = 1, 5
    out = args.out or (None if args.small else Path(__file__).resolve().parent / "results" / "fleet.json")
    meta = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "shared": True},
            "commit": _git_commit(), "engine_dtype": args.dtype, "engine_tp": args.engine_tp,
            "prompt_tokens": PROMPT_LEN}  # fmt: skip
    results = []
    try:
        route = route_cost(args.prompts)
        for model in args.models:
            hf_dir = hf_model(args.model_dir, model)
            res = run_model(model, hf_dir, args.work_dir, args.engines, args.prompts, args.tokens, args.repeats,
                            args.latency_reps, dtype=args.dtype, engine_tp=args.engine_tp,
                            gpu_memory_utilization=args.gpu_memory_utilization)
            res["route"] = route
            results.append(res)
            if out is not None:
                meta["load_avg_end"] = os.getloadavg()
                write_json(out, {"meta": meta, "results": results})
    except SanityCheckFailed as err:
        print(f"SANITY CHECK FAILED: {err}", file=sys.stderr)
        sys.exit(1)
    meta["load_avg_end"] = os.getloadavg()
    print(json.dumps({"meta": meta, "results": results}))
    print(tables(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
