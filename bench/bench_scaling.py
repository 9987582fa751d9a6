"""Scaling: how the time of a training step grows with sequence length and with the number of turns.

    .venv/bin/python bench/bench_scaling.py [--tokens 8192] [--trajectories 2] [--reps 2] [--out-dir bench/results]

Place in the data flow (docs/DESIGN.md sections 1-3, 6): the Megatron model stage, with the same tiny model and step
as ``bench_throughput.py`` (forward + backward of the summed response log-likelihood, one micro-batch).

1. Sequence length: a fixed budget of ``--tokens`` tokens per step, cut into ``tokens / L`` sequences of
   exactly L tokens (prompt/response split at random), packed; L doubles from 128 to 4096. The same tokens
   go through the linear layers at every L, so the growth is attention's (O(L^2) per sequence, O(L) per token)
   plus the per-sequence overheads that shrink as sequences get fewer.
2. Turns: ``--trajectories`` step-wise trajectories (bench/workloads.py) of T = 1, 2, 4, 8, 16 turns; padded,
   packed and merged+packed, as in bench_throughput.py. Without merging, the tokens grow as O(T^2).

Each point is the minimum over ``--reps`` repetitions (the machine is shared; the minimum is the least
disturbed), after one warm-up step. Writes ``scaling.md`` (tables), ``scaling.json`` and ``scaling.png`` to
``--out-dir``. Sanity checks (exit non-zero): the variants' losses agree at every T, merged+packed never has more
tokens than packed, packed never more than padded.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_throughput import (
    VOCAB_SIZE,
    ModelInput,
    batch_tensors,
    build_model,
    check_same_training,
    packed_input,
    tiny_model_config,
    train_step,
    variant_inputs,
    workload,
)
from workloads import print_report_or_exit, IndependentSpec, check, independent_workload, markdown_table

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
TURNS = (1, 2, 4, 8, 16)


def best_time(model: torch.nn.Module, inp: ModelInput, reps: int) -> tuple[float, tuple[float, float]]:
    """``(min step seconds over reps, (loss, grad norm))``."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = train_step(model, inp)
        times.append(time.perf_counter() - start)
    return min(times), result


def length_sweep(model: torch.nn.Module, tokens: int, lengths: tuple[int, ...], reps: int) -> list[dict]:
    points = []
    for length in lengths:
        rows = tokens // length
        check(rows >= 1 and rows * length == tokens, f"--tokens={tokens} must be a multiple of L={length}")
        spec = IndependentSpec(num_sequences=rows, mean_len=length, jitter=0, vocab_size=VOCAB_SIZE, seed=length)
        inp = packed_input(*batch_tensors(independent_workload(spec)))
        check(inp.slots == rows * length, f"L={length}: packed tokens {inp.slots} != rows x L")
        seconds, _ = best_time(model, inp, reps)
        points.append({"length": length, "rows": rows, "tokens": inp.slots, "seconds": seconds})
    return points


def turn_sweep(model: torch.nn.Module, trajectories: int, turns: tuple[int, ...], reps: int) -> list[dict]:
    points = []
    for num_turns in turns:
        inputs = variant_inputs(workload(trajectories, num_turns))
        slots = {name: inp.slots for name, inp in inputs.items()}
        check(slots["merged+packed"] <= slots["packed"] <= slots["padded"], f"T={num_turns}: slots {slots}")
        measured = {name: best_time(model, inp, reps) for name, inp in inputs.items()}
        check_same_training({name: result for name, (_, result) in measured.items()})
        seconds = {name: s for name, (s, _) in measured.items()}
        points.append({"turns": num_turns, "rows": trajectories * num_turns, "slots": slots, "seconds": seconds})
    return points


def length_table(points: list[dict]) -> str:
    rows = []
    for i, p in enumerate(points):
        growth = f"{p['seconds'] / points[i - 1]['seconds']:.2f}x" if i else "-"
        rows.append([p["length"], p["rows"], p["tokens"], f"{p['seconds']:.3f}", growth,
                     f"{1e6 * p['seconds'] / p['tokens']:.1f}"])  # fmt: skip
    return markdown_table(["L", "sequences", "tokens", "step s", "vs previous L", "us per token"], rows)


def turn_table(points: list[dict]) -> str:
    names = list(points[0]["seconds"])
    rows = [[p["turns"], p["rows"], *(p["slots"][n] for n in names), *(f"{p['seconds'][n]:.3f}" for n in names),
             f"{p['seconds']['padded'] / p['seconds']['merged+packed']:.1f}x"] for p in points]  # fmt: skip
    header = ["T", "rows", *(f"{n} slots" for n in names), *(f"{n} step s" for n in names),
              "padded / merged+packed"]  # fmt: skip
    return markdown_table(header, rows)


def plot(lengths: list[dict], turns: list[dict], trajectories: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.semilogx([p["length"] for p in lengths], [p["seconds"] for p in lengths], "o-", label="packed", base=2)
    left.set_ylim(bottom=0)
    left.set(xlabel="sequence length L (tokens)", ylabel="step time (s)",
             title=f"fwd+bwd, {lengths[0]['tokens']} tokens per step as sequences of L")  # fmt: skip
    for name in turns[0]["seconds"]:
        right.loglog([p["turns"] for p in turns], [p["seconds"][name] for p in turns], "o-", label=name, base=2)
    right.set(xlabel="turns per trajectory T", ylabel="step time (s)",
              title=f"fwd+bwd, {trajectories} step-wise trajectories of T turns")  # fmt: skip
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("megatron_rl tiny model on CPU (min over repetitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(tokens: int, trajectories: int, reps: int, out_dir: Path, lengths: tuple[int, ...] = LENGTHS,
        turns: tuple[int, ...] = TURNS) -> dict[str, object]:  # fmt: skip
    """Both sweeps; writes scaling.{md,json,png} to ``out_dir``; raises SanityCheckFailed."""
    model = build_model(tiny_model_config(max(max(lengths), 4096)))
    train_step(model, packed_input(*batch_tensors(workload(trajectories, 1))))  # warm-up
    length_points = length_sweep(model, tokens, lengths, reps)
    turn_points = turn_sweep(model, trajectories, turns, reps)
    report = "\n\n".join([
        f"### Step time vs sequence length ({tokens} tokens per step, packed sequences of L tokens)",
        length_table(length_points),
        f"### Step time vs turns ({trajectories} step-wise trajectories of T turns)", turn_table(turn_points),
    ])  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scaling.md").write_text(report + "\n")
    (out_dir / "scaling.json").write_text(json.dumps({"lengths": length_points, "turns": turn_points}, indent=1))
    plot(length_points, turn_points, trajectories, out_dir / "scaling.png")
    return {"lengths": length_points, "turns": turn_points, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step in the length sweep")
    parser.add_argument("--trajectories", type=int, default=2, help="trajectories per step in the turn sweep")
    parser.add_argument("--reps", type=int, default=2, help="repetitions per point (minimum is reported)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared 2-core machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sweeps (smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths, turns = (LENGTHS[:2], TURNS[:2]) if args.quick else (LENGTHS, TURNS)
    if args.quick:
        args.tokens, args.trajectories, args.reps = 512, 1, 1
    print_report_or_exit(lambda: run(args.tokens, args.trajectories, args.reps, args.out_dir, lengths, turns))
    print(f"\nwritten: {args.out_dir / 'scaling.md'}, scaling.json, scaling.png")


if __name__ == "__main__":
    main()
