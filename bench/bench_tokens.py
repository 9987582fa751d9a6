"""Token efficiency: how many token slots each batch layout allocates, relative to the real tokens (no model).

    .venv/bin/python bench/bench_tokens.py [--trajectories 64] [--turns 8] [--quick]

Place in the data flow (docs/DESIGN.md sections 2, 3, 6): the batches are built with the library's own functions
(``merge_stepwise_output``, ``convert_prompts_responses_to_batch_tensors``, ``pack``); only the count of token
slots is measured. Layouts, for B rows with prompt p_i and response r_i:

    two-segment   B * (max p + max r)          the old [prompt block | response block] layout
    unified       B * max(p + r)               the left-padded block of docs/DESIGN.md section 2 ([B, S])
    packed tp=a   sum_i ceil((p_i + r_i) / a) * a     THD stream, alignment a (1; tp=2 and tp=8 under SP)
    merged+packed the same after merge_stepwise_output (each trajectory's turns become one sequence)

Ratios are against the physical minimum, the *unique* tokens (each trajectory's final context counted once; =
the real tokens for non-step-wise data), and against the real tokens of the unmerged rows ``sum_i (p_i + r_i)``.
The second table shows the merge reduction against the number of turns T (rows O(T^2) -> merged O(T)).
Exits non-zero when a sanity check fails (e.g. packed below real, merged above unmerged); no timing here.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from megatron_rl.data import GeneratorOutput, convert_prompts_responses_to_batch_tensors, merge_stepwise_output, pack

from workloads import (
    print_report_or_exit,
    IndependentSpec,
    StepWiseSpec,
    check,
    independent_workload,
    markdown_table,
    real_tokens,
    stepwise_workload,
    trained_tokens,
    unique_tokens,
)

ALIGNMENTS = (1, 2, 8)
"""Packing alignments reported: no SP (1), sequence parallel with tp=2 and tp=8."""
TURN_SWEEP = (1, 2, 4, 8, 16)


def layout_tokens(out: GeneratorOutput, alignments: tuple[int, ...] = ALIGNMENTS) -> dict[str, int]:
    """Token slots of each layout for the rows of ``out`` (see the module docstring)."""
    prompts, responses = out["prompt_token_ids"], out["response_ids"]
    sequences, attention_mask, response_mask, *_ = convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, out["rewards"], out["loss_masks"]
    )  # [B, S], [B, S], [B, R]
    rows = len(prompts)
    counts = {
        "real": real_tokens(out),
        "two-segment": rows * (max(map(len, prompts)) + max(map(len, responses))),
        "unified": sequences.numel(),
    }
    for align in alignments:
        counts[f"packed tp={align}"] = pack(sequences, attention_mask, align).total_len
    check(int(attention_mask.sum()) == counts["real"], "attention_mask counts every real token once")
    check(response_mask.shape[1] == max(map(len, responses)), "R = max response length")
    return counts


def check_layouts(counts: dict[str, int], alignments: tuple[int, ...] = ALIGNMENTS) -> None:
    """Orderings that hold for any data: packing never drops or adds real tokens beyond alignment."""
    real = counts["real"]
    check(real <= counts["unified"] <= counts["two-segment"], f"real <= unified <= two-segment: {counts}")
    check(counts["packed tp=1"] == real, f"alignment 1 packs exactly the real tokens: {counts}")
    packed = [counts[f"packed tp={a}"] for a in alignments]
    check(all(p >= real for p in packed), f"packed tokens below the real count: {counts}")
    check(packed == sorted(packed), f"coarser alignment never packs fewer tokens: {counts}")


def efficiency(out: GeneratorOutput, step_wise: bool) -> tuple[dict[str, int], dict[str, int]]:
    """``(slots per layout, slots per layout after merging)`` ({} when not step-wise), sanity-checked."""
    before = layout_tokens(out)
    check_layouts(before)
    if not step_wise:
        check(before["real"] == unique_tokens(out), "non-step-wise: real tokens are unique tokens")
        return before, {}
    merged_out, stats = merge_stepwise_output(out)
    after = layout_tokens(merged_out)
    check_layouts(after)
    num_trajectories = sum(out["is_last_step"])
    check(stats["num_seq_after_merge"] == num_trajectories, f"every trajectory merges into one sequence: {stats}")
    check(after["real"] == unique_tokens(out), "merged tokens = each trajectory's final context")
    check(after["real"] <= before["real"], "merged tokens above unmerged")
    check(trained_tokens(merged_out) == trained_tokens(out), "merging keeps every trained (loss-masked) token")
    return before, after


def efficiency_table(before: dict[str, int], after: dict[str, int], minimum: int) -> str:
    rows = [_ratio_row(name, n, minimum, before["real"]) for name, n in before.items()]
    rows += [_ratio_row(f"merged + {name}", n, minimum, before["real"]) for name, n in after.items() if name != "real"]
    return markdown_table(["layout", "token slots", "/ unique tokens", "/ real tokens of the rows"], rows)


def _ratio_row(name: str, n: int, minimum: int, real: int) -> list[object]:
    return [name, n, f"{n / minimum:.3f}", f"{n / real:.3f}"]


def turn_sweep(spec: StepWiseSpec, turns: tuple[int, ...] = TURN_SWEEP) -> list[dict[str, float]]:
    """Tokens before/after merging (alignment 1) for each number of turns, same trajectories otherwise."""
    results = []
    for num_turns in turns:
        out = stepwise_workload(replace(spec, turns=num_turns))
        before, after = efficiency(out, step_wise=True)
        results.append({"turns": num_turns, "rows": len(out["uids"]), "before": before["real"],
                        "after": after["real"], "unified_before": before["unified"],
                        "unified_after": after["unified"]})  # fmt: skip
    for prev, cur in zip(results, results[1:]):
        check(cur["before"] - prev["before"] >= cur["after"] - prev["after"], "merged tokens grow slower than rows")
    return results


def sweep_table(results: list[dict[str, float]]) -> str:
    """One row per T; the marginal columns are the tokens one more turn adds (between successive T): growing
    linearly with T for an O(T^2) total, flat for an O(T) total."""
    rows = []
    for i, r in enumerate(results):
        marginal = lambda key: f"{_marginal(results[i - 1], r, key):.0f}" if i else "-"  # noqa: E731
        rows.append([r["turns"], r["rows"], r["before"], r["after"], f"{r['before'] / r['after']:.2f}",
                     marginal("before"), marginal("after"), r["unified_before"], r["unified_after"]])  # fmt: skip
    header = ["T", "rows", "tokens before merge", "tokens after merge", "before / after",
              "tokens per extra turn, before", "tokens per extra turn, after", "unified slots before",
              "unified slots after"]  # fmt: skip
    return markdown_table(header, rows)


def _marginal(a: dict[str, float], b: dict[str, float], key: str) -> float:
    """Tokens added per extra turn between two sweep points."""
    return (b[key] - a[key]) / (b["turns"] - a["turns"])


def run(trajectories: int, turns: int, sequences: int, quick: bool = False) -> dict[str, object]:
    """All measurements and their markdown report (raises SanityCheckFailed)."""
    spec = StepWiseSpec(num_trajectories=trajectories, turns=turns)
    stepwise = stepwise_workload(spec)
    before, after = efficiency(stepwise, step_wise=True)
    independent = independent_workload(IndependentSpec(num_sequences=sequences))
    single, _ = efficiency(independent, step_wise=False)
    sweep = turn_sweep(spec, TURN_SWEEP[:3] if quick else TURN_SWEEP)
    report = "\n\n".join([
        f"### Step-wise workload: {trajectories} trajectories x {turns} turns = {len(stepwise['uids'])} rows, "
        f"{unique_tokens(stepwise)} unique tokens, {before['real']} real tokens in the rows",
        efficiency_table(before, after, unique_tokens(stepwise)),
        f"### Non-step-wise workload: {sequences} sequences, {single['real']} real tokens",
        efficiency_table(single, {}, single["real"]),
        f"### Merge reduction vs turns T ({trajectories} trajectories)",
        sweep_table(sweep),
    ])  # fmt: skip
    return {"stepwise": before, "merged": after, "independent": single, "sweep": sweep, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=64, help="step-wise trajectories")
    parser.add_argument("--turns", type=int, default=8, help="turns per trajectory (main table)")
    parser.add_argument("--sequences", type=int, default=256, help="non-step-wise sequences")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.trajectories, args.turns, args.sequences = 8, 4, 16
    print_report_or_exit(lambda: run(args.trajectories, args.turns, args.sequences, quick=args.quick))


if __name__ == "__main__":
    main()
