"""Asynchronous RL on this machine: seconds per RL step with ``rollout.max_staleness`` K = 0, 1, 2, side by side in
one run, on the main job as a user runs it (``run_megatron.sh``, ``configs/demo_vllm.yaml``: one vLLM engine, the
trainer's ranks beside it on the same cores).

    MEGATRON_RL_ENGINE_PYTHON=.venv-engine/bin/python .venv/bin/python bench/bench_async.py \\
        [--staleness 0 1 2] [--partial 1] [--steps 16] [--shapes demo gen-heavy] [--nproc 2] [--small] \
        [--config configs/demo_vllm.yaml] [job overrides ...]

Place in the data flow: ``job/main.py: rl_step`` with ``job/pipeline.py``: at K > 0 the fleet generates the batch
of step t+K while the trainer trains step t; the drain before the weight sync waits for it. Per (shape, K) one run
of ``--steps`` steps (a fresh engine each); the first ``WARMUP`` steps (start-up, the first batch that nothing
overlaps) are left out. Reported medians over the remaining steps, from ``metrics.jsonl``:

- ``step s``: ``timing/step_s`` (rollout wait + training + sync);
- ``generate s``: ``timing/rollout_s``, the generation of one batch (concurrent with training at K > 0);
- ``wait s``: ``timing/rollout_wait_s``, the part of it the trainer waited for (K = 0: all of it);
- ``train s``: step - wait - sync;
- ``staleness``: the mean of ``rollout/staleness_mean`` over the measured steps (per token with partial rollouts:
  ``--partial K`` runs K with ``rollout.partial_rollouts=true`` as well).

Shapes: ``demo`` is ``configs/demo_vllm.yaml`` as shipped, where on 2 cores generating a batch and training on it
take about the same time (where overlapping them can gain the most: at most 2x); ``gen-heavy`` doubles the turns
of each game (``next_digit.num_turns=6``: twice the generation calls) and halves the training passes
(``batch.update_epochs_per_batch=1``).

Sanity checks (non-zero exit): every run finishes; the staleness of the measured steps is exactly K (partial
rollouts: within [0, K]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_weight_sync import SanityCheckFailed, _git_commit, check, write_json

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3
SHAPES = {"demo": [], "gen-heavy": ["next_digit.num_turns=6", "batch.update_epochs_per_batch=1"]}


def run_job(out: Path, staleness: int, steps: int, nproc: int, extra: list[str], config: Path) -> list[dict]:
    """One run of the main job; its metrics rows."""
    env = {**os.environ, "PY": sys.executable, "NPROC": str(nproc), "CONFIG": str(config)}
    env.pop("MASTER_PORT", None)  # run_megatron.sh picks a free one
    args = [f"logging.output_dir={out}", "logging.progress_bar=false", f"job.num_steps={steps}",
            f"rollout.max_staleness={staleness}", "checkpoint.save_interval=0", "eval.interval=0",
            "demo.baseline_episodes=50", *extra]
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    check(proc.returncode == 0, f"the run K={staleness} {extra} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict], staleness: int, partial: bool = False) -> dict:
    """Medians over the rows after the warm-up (see the module docstring)."""
    measured = rows[WARMUP:]
    check(bool(measured), f"no step after the {WARMUP} warm-up steps")

    def median(key: str, default: float = 0.0) -> float:
        return statistics.median(r.get(key, default) for r in measured)

    step, sync = median("timing/step_s"), median("timing/weight_sync_s")
    wait = median("timing/rollout_wait_s") if staleness else median("timing/rollout_s")
    stale = [r["rollout/staleness_mean"] for r in measured]
    if partial:
        check(all(0 <= s <= staleness for s in stale), f"K={staleness} partial: measured staleness {stale}")
    else:
        check(set(stale) == {staleness}, f"K={staleness}: measured staleness {sorted(set(stale))}")
    return {"step_s": step, "generate_s": median("timing/rollout_s"), "wait_s": wait, "sync_s": sync,
            "train_s": step - wait - sync, "staleness": statistics.fmean(stale)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--partial", type=int, nargs="*", default=[1], help="K values also run with partial rollouts")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (DP)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo_vllm.yaml",
                        help="the job's config (GPU: a GPU config with rollout.engine=vllm)")
    parser.add_argument("overrides", nargs="*", help="more job overrides for every run")
    parser.add_argument("--small", action="store_true", help="K 0 and 1, 5 steps, the demo shape")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async.json")
    args = parser.parse_args(argv)
    if args.small:
        args.staleness, args.partial, args.steps, args.shapes = [0, 1], [], WARMUP + 2, ["demo"]
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
            variants = [(k, False) for k in args.staleness] + [(k, True) for k in args.partial]
            for shape in args.shapes:
                for k, partial in variants:
                    started = time.time()
                    extra = SHAPES[shape] + (["rollout.partial_rollouts=true"] if partial else []) + args.overrides
                    rows = run_job(Path(tmp) / f"{shape}_k{k}{'p' if partial else ''}", k, args.steps, args.nproc,
                                   extra, args.config)
                    result = {"shape": shape, "max_staleness": k, "partial": partial,
                              **summarize(rows, k, partial), "wall_s": time.time() - started}
                    results.append(result)
                    print(json.dumps(result), flush=True)
    except SanityCheckFailed as err:
        print(f"bench_async: sanity check failed: {err}", file=sys.stderr)
        return 1
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    write_json(args.out, {"commit": _git_commit(), "steps": args.steps, "warmup": WARMUP, "nproc": args.nproc,
                          "cores": os.cpu_count(), "load_after": load, "results": results})
    print("\n| shape | K | step s | generate s | wait s | train s | sync s | staleness |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        k = f"{r['max_staleness']}{' partial' if r['partial'] else ''}"
        print(f"| {r['shape']} | {k} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['wait_s']:.2f} "
              f"| {r['train_s']:.2f} | {r['sync_s']:.2f} | {r['staleness']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
