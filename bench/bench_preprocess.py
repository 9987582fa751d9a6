"""Preprocessing overhead: the data layer's cost for a 4,096-sequence step-wise batch, as a fraction of a step.

    .venv/bin/python bench/bench_preprocess.py [--trajectories 512] [--turns 8] [--quick]

Place in the data flow (docs/DESIGN.md section 1): everything between the rollouts and the Megatron model, run on
the host once per training batch. Two pipelines over the same rollouts (``trajectories * turns`` sequences):

    rows:    validate -> convert ([B, S] block) -> prompt mini-batch boundaries -> micro-batch plan + pack
    merged:  merge_stepwise_output (validates) -> convert -> boundaries -> micro-batch plan + pack

Micro-batches: a token budget (``--max-tokens``, first-fit-decreasing, ``data/microbatch.py``) per mini-batch
of ``--mini-batch-prompts`` prompts, packed with alignment 1 (``data.pack``). Each stage is timed (median of
``--reps`` runs).

The *training step* the overhead is compared to is one forward + backward (bench_throughput.train_step) over
every packed micro-batch of the batch, **estimated**: the tiny benchmark model's measured time per packed
token on ``--sample`` micro-batches of that same pipeline (spread over the batch), times the pipeline's packed
tokens. Both sides are measured in wall time and in CPU time of this process (``time.process_time``, one
torch thread): on the shared machine the wall times of both swing with the load, the CPU-time ratio much less.
This is for the ~0.5 M-parameter CPU model; a real model's step costs orders of magnitude more per
token while preprocessing does not change, so for real models the fraction is far smaller. No optimizer step.
Exits non-zero when a sanity check fails (every row packed once, merged tokens fewer, trained tokens kept).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_rl.data import (
    GeneratorOutput,
    PackedBatch,
    compute_prompt_mini_batch_boundaries,
    merge_stepwise_output,
    pack,
    validate_generator_output,
)
from megatron_rl.data.microbatch import plan_microbatches

from bench_throughput import PackedInput, batch_tensors, build_model, tiny_model_config, train_step, workload
from workloads import print_report_or_exit, check, markdown_table, real_tokens, trained_tokens, unique_tokens


class Clock(NamedTuple):
    """Elapsed wall and CPU seconds."""

    wall: float
    cpu: float

    @staticmethod
    def now() -> Clock:
        return Clock(time.perf_counter(), time.process_time())

    def since(self, start: Clock) -> Clock:
        return Clock(self.wall - start.wall, self.cpu - start.cpu)


@dataclass
class Prepared:
    """What preprocessing hands to the model: packed micro-batches with their loss masks."""

    micro_batches: list[PackedInput]
    stage_seconds: dict[str, Clock]

    @property
    def packed_tokens(self) -> int:
        return sum(mb.packed.total_len for mb in self.micro_batches)


def _timed(stage_seconds: dict[str, Clock], name: str, fn: Callable, *args):
    start = Clock.now()
    result = fn(*args)
    stage_seconds[name] = Clock.now().since(start)
    return result


def pack_minibatches(sequences: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     boundaries: list[tuple[int, int]], max_tokens: int) -> list[PackedInput]:  # fmt: skip
    """Token-budget micro-batches of each mini-batch, packed (alignment 1). ``[B, S]`` in, ``[1, T]`` packs out."""
    packs = []
    lengths = attention_mask.sum(dim=1).tolist()
    for start, end in boundaries:
        (plan,) = plan_microbatches(lengths[start:end], 1, max_tokens_per_micro_batch=max_tokens)
        for rows in plan:
            index = torch.tensor(rows, dtype=torch.long) + start
            packed: PackedBatch = pack(sequences[index], attention_mask[index])
            packs.append(PackedInput(packed=packed, loss_mask=loss_mask[index]))
    return packs


def preprocess(out: GeneratorOutput, merge: bool, mini_batch_prompts: int, max_tokens: int) -> Prepared:
    """One pipeline of the module docstring, each stage timed."""
    seconds: dict[str, Clock] = {}
    if merge:
        out, _ = _timed(seconds, "merge (incl. validation)", merge_stepwise_output, out)
    else:
        _timed(seconds, "validate", validate_generator_output, out, True)
    tensors = _timed(seconds, "convert", batch_tensors, out)
    boundaries = _timed(seconds, "mini-batch boundaries", compute_prompt_mini_batch_boundaries, out["uids"],
                        mini_batch_prompts)  # fmt: skip
    packs = _timed(seconds, "micro-batch plan + pack", pack_minibatches, *tensors, boundaries, max_tokens)
    return Prepared(micro_batches=packs, stage_seconds=seconds)


def median_stages(runs: list[Prepared]) -> dict[str, Clock]:
    """Per stage, the median wall and the median CPU seconds over the runs."""
    return {
        name: Clock(*(statistics.median(getattr(r.stage_seconds[name], f) for r in runs) for f in Clock._fields))
        for name in runs[0].stage_seconds
    }


def seconds_per_packed_token(model: torch.nn.Module, micro_batches: list[PackedInput], sample: int) -> Clock:
    """Measured fwd+bwd (wall, CPU) seconds per packed token on ``sample`` micro-batches spread over the list (1 warm-up)."""
    picks = [micro_batches[round(i * (len(micro_batches) - 1) / max(1, sample - 1))] for i in range(sample)]
    train_step(model, picks[0])
    start = Clock.now()
    for mb in picks:
        train_step(model, mb)
    elapsed, tokens = Clock.now().since(start), sum(mb.packed.total_len for mb in picks)
    return Clock(elapsed.wall / tokens, elapsed.cpu / tokens)


def check_prepared(out: GeneratorOutput, rows: Prepared, merged: Prepared) -> None:
    check(rows.packed_tokens == real_tokens(out), "rows pipeline packs every real token exactly once")
    check(merged.packed_tokens == unique_tokens(out), "merged pipeline packs each trajectory's context once")
    check(merged.packed_tokens < rows.packed_tokens, "merged tokens above unmerged")
    for prepared in (rows, merged):
        masked = sum(int(mb.loss_mask.sum()) for mb in prepared.micro_batches)
        check(masked == trained_tokens(out), "every trained token reaches a micro-batch")


def run(trajectories: int, turns: int, mini_batch_prompts: int, max_tokens: int, reps: int,
        sample: int) -> dict[str, object]:  # fmt: skip
    """Preprocessing timings and the estimated step; raises SanityCheckFailed."""
    out = workload(trajectories, turns)
    results = {}
    for name, merge in (("rows", False), ("merged", True)):
        runs = [preprocess(out, merge, mini_batch_prompts, max_tokens) for _ in range(reps)]
        results[name] = (runs[0], median_stages(runs))
    check_prepared(out, results["rows"][0], results["merged"][0])
    model = build_model(tiny_model_config())
    table_rows = []
    for name, (prepared, stages) in results.items():
        per_token = seconds_per_packed_token(model, prepared.micro_batches, sample)
        step = Clock(per_token.wall * prepared.packed_tokens, per_token.cpu * prepared.packed_tokens)
        table_rows.append(_row(name, prepared, stages, step))
    header = (f"{len(out['uids'])} sequences ({trajectories} trajectories x {turns} turns), {real_tokens(out)} "
              f"real tokens, {unique_tokens(out)} after merging; micro-batches of <= {max_tokens} tokens")  # fmt: skip
    stage_names = sorted({s for _, stages in results.values() for s in stages}, key=_stage_order)
    table = markdown_table(["pipeline", "micro-batches", "packed tokens"] + [f"{s} s" for s in stage_names]
                           + ["preprocess total s", "est. fwd+bwd step s (tiny model)", "preprocess / step",
                              "preprocess CPU s", "est. step CPU s", "preprocess / step (CPU)"],
                           [_fill(r, stage_names) for r in table_rows])  # fmt: skip
    return {"results": results, "rows": table_rows, "report": header + "\n\n" + table}


def _stage_order(name: str) -> int:
    order = ("validate", "merge (incl. validation)", "convert", "mini-batch boundaries", "micro-batch plan + pack")
    return order.index(name)


def _row(name: str, prepared: Prepared, stages: dict[str, Clock], step: Clock) -> dict[str, object]:
    total = Clock(sum(c.wall for c in stages.values()), sum(c.cpu for c in stages.values()))
    return {"pipeline": name, "micro_batches": len(prepared.micro_batches), "packed": prepared.packed_tokens,
            "stages": stages, "total": total, "step": step, "fraction": total.wall / step.wall,
            "cpu_fraction": total.cpu / step.cpu}  # fmt: skip


def _fill(row: dict[str, object], stage_names: list[str]) -> list[object]:
    stages = [f"{row['stages'][s].wall:.3f}" if s in row["stages"] else "-" for s in stage_names]
    total, step = row["total"], row["step"]
    return [row["pipeline"], row["micro_batches"], row["packed"], *stages, f"{total.wall:.3f}", f"{step.wall:.1f}",
            f"{100 * row['fraction']:.2f}%", f"{total.cpu:.3f}", f"{step.cpu:.1f}",
            f"{100 * row['cpu_fraction']:.2f}%"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=512, help="x turns = sequences (4,096 by default)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--mini-batch-prompts", type=int, default=32, help="prompts per mini-batch (4 rollouts each)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="token budget per micro-batch")
    parser.add_argument("--reps", type=int, default=3, help="preprocessing repetitions (median)")
    parser.add_argument("--sample", type=int, default=3, help="micro-batches timed per pipeline for the step estimate")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared 2-core machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.trajectories, args.turns, args.mini_batch_prompts, args.max_tokens = 8, 4, 1, 2048
        args.reps, args.sample = 1, 1
    print_report_or_exit(
        lambda: run(args.trajectories, args.turns, args.mini_batch_prompts, args.max_tokens, args.reps, args.sample)
    )


if __name__ == "__main__":
    main()
