"""Benchmark of the pure data layer (not a test): batch conversion, step-wise merging, THD packing.

    .venv/bin/python bench/bench_data.py [--sequences 4096] [--trajectories 1024] [--turns 8]

Conversion: 4,096 sequences of mean 2,048 tokens with anti-correlated prompt/response lengths (target: < 1 s on
the 2-core dev machine). Merge: 1,024 trajectories of 8 turns whose prompts extend the history. Prints wall time
and tokens/s; exits non-zero when a sanity check (token counts, layout) fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_rl.data import convert_prompts_responses_to_batch_tensors, merge_stepwise_output, pack, unpack_response

CONVERT_TARGET_S = 1.0


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"SANITY CHECK FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def make_rollouts(num_seqs: int, mean_len: int, rng: np.random.Generator) -> dict:
    """Anti-correlated lengths: total = mean +- 64, p ~ U[32, total - 32), r = total - p."""
    total_lens = mean_len + rng.integers(-64, 65, num_seqs)
    prompt_lens = rng.integers(32, total_lens - 32)
    response_lens = total_lens - prompt_lens
    return {
        "prompt_token_ids": [rng.integers(1, 32000, p).tolist() for p in prompt_lens],
        "response_ids": [rng.integers(1, 32000, r).tolist() for r in response_lens],
        "loss_masks": [rng.integers(0, 2, r).tolist() for r in response_lens],
        "rollout_logprobs": [(-rng.random(r)).tolist() for r in response_lens],
        "rewards": rng.random(num_seqs).tolist(),
    }


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, str]:
    """``(result, best_wall_s, detail)`` over ``repeats`` calls. The machine is shared, so the best wall time is
    the cleanest, and the process CPU time (insensitive to other processes' load) is reported next to it."""
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    return result, min(walls), f"median {statistics.median(walls):.3f} s, best CPU time {min(cpus):.3f} s"


def bench_convert(num_seqs: int, mean_len: int, rng: np.random.Generator, repeats: int) -> None:
    out = make_rollouts(num_seqs, mean_len, rng)
    args = (out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"], out["rollout_logprobs"])
    result, elapsed, detail = timed(lambda: convert_prompts_responses_to_batch_tensors(0, *args), repeats)
    seqs, attn, resp_mask, rewards, loss_mask, logprobs = result
    num_prompt = sum(map(len, out["prompt_token_ids"]))
    num_response = sum(map(len, out["response_ids"]))
    total = num_prompt + num_response
    status = "OK" if elapsed < CONVERT_TARGET_S else f"MISSED target {CONVERT_TARGET_S:.1f} s"
    two_segment_width = max(map(len, out["prompt_token_ids"])) + resp_mask.shape[1]
    print(
        f"convert: {num_seqs} seqs, {total / 1e6:.2f} M tokens, [B,S]={tuple(seqs.shape)}, "
        f"[B,R]={tuple(resp_mask.shape)} (two-segment layout would be S={two_segment_width}): "
        f"best {elapsed:.3f} s ({detail}), {total / elapsed / 1e6:.1f} M tokens/s [{status}]"
    )
    check(int(attn.sum()) == total, "attention_mask counts every token once")
    check(int(resp_mask.sum()) == num_response, "response_mask counts every response token")
    check(int(loss_mask.sum()) == sum(map(sum, out["loss_masks"])), "loss-masked token count")
    check(seqs.shape[1] == max(len(p) + len(r) for p, r in zip(out["prompt_token_ids"], out["response_ids"])), "S")
    for i in (0, num_seqs // 2, num_seqs - 1):
        check(seqs[i][attn[i].bool()].tolist() == out["prompt_token_ids"][i] + out["response_ids"][i], f"row {i}")
    check(torch.allclose(rewards[:, -1], torch.tensor(out["rewards"], dtype=torch.float32)), "scalar rewards")
    bench_pack(seqs, attn, resp_mask.shape[1])


def bench_pack(seqs: torch.Tensor, attn: torch.Tensor, width: int, micro_batch: int = 16) -> None:
    start = time.perf_counter()
    starts = range(0, len(seqs), micro_batch)
    packed = [pack(seqs[s : s + micro_batch], attn[s : s + micro_batch], align=8) for s in starts]
    elapsed = time.perf_counter() - start
    total = int(attn.sum())
    print(
        f"pack:    {len(packed)} micro-batches of {micro_batch} rows, align 8: {elapsed:.3f} s, "
        f"{total / elapsed / 1e6:.1f} M tokens/s"
    )
    check(sum(int(p.seq_lens.sum()) for p in packed) == total, "packed token count")
    start = time.perf_counter()
    for p in packed:
        unpack_response(p.label_mask.float(), p, width)
    print(f"unpack:  {len(packed)} micro-batches: {time.perf_counter() - start:.3f} s")


def make_trajectories(num_traj: int, turns: int, rng: np.random.Generator) -> tuple[dict, int, int]:
    """Multi-turn steps: prompt of turn t = prompt + response of turn t-1 + an observation of 16-48 tokens."""
    out = {k: [] for k in ("prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs", "rewards", "uids",
                           "trajectory_ids", "is_last_step")}
    for traj in range(num_traj):
        history = rng.integers(1, 32000, int(rng.integers(64, 192))).tolist()
        for turn in range(turns):
            response = rng.integers(1, 32000, int(rng.integers(16, 112))).tolist()
            out["prompt_token_ids"].append(history)
            out["response_ids"].append(response)
            out["loss_masks"].append([1] * len(response))
            out["rollout_logprobs"].append((-rng.random(len(response))).tolist())
            out["rewards"].append(float(turn == turns - 1))
            out["uids"].append(traj // 8)
            out["trajectory_ids"].append((traj // 8, traj % 8))
            out["is_last_step"].append(turn == turns - 1)
            history = history + response + rng.integers(1, 32000, int(rng.integers(16, 48))).tolist()
    num_tokens = sum(map(len, out["prompt_token_ids"])) + sum(map(len, out["response_ids"]))
    return out, num_tokens, sum(map(len, out["response_ids"]))


def bench_merge(num_traj: int, turns: int, rng: np.random.Generator, repeats: int) -> None:
    out, num_tokens, num_response = make_trajectories(num_traj, turns, rng)
    (merged, counts), elapsed, detail = timed(lambda: merge_stepwise_output(out), repeats)
    print(
        f"merge:   {num_traj} trajectories x {turns} turns, {num_tokens / 1e6:.2f} M input tokens: "
        f"best {elapsed:.3f} s ({detail}), {num_tokens / elapsed / 1e6:.1f} M tokens/s; {counts}"
    )
    check(counts == {"num_seq_before_merge": num_traj * turns, "num_seq_after_merge": num_traj}, "merge counts")
    check(sum(map(sum, merged["loss_masks"])) == num_response, "every loss-masked token kept")
    check(all(len(lp) == len(r) for lp, r in zip(merged["rollout_logprobs"], merged["response_ids"])), "logprobs")
    last_prompt_plus_response = [
        out["prompt_token_ids"][i] + out["response_ids"][i] for i in range(len(out["uids"])) if out["is_last_step"][i]
    ]
    check([p + r for p, r in zip(merged["prompt_token_ids"], merged["response_ids"])] == last_prompt_plus_response,
          "merged sequence = final turn's full context")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--mean-len", type=int, default=2048)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bench_convert(args.sequences, args.mean_len, rng, args.repeats)
    bench_merge(args.trajectories, args.turns, rng, args.repeats)


if __name__ == "__main__":
    main()
