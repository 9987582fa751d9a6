"""Training throughput on CPU: one step-wise batch, three layouts, the same tiny Megatron model.

    .venv/bin/python bench/bench_throughput.py [--trajectories 8] [--turns 4] [--reps 5] [--quick]

Place in the data flow (docs/DESIGN.md sections 1-3): the "Megatron model" stage. One process,
``initialize_distributed`` (gloo, one rank) then ``build_gpt_model`` (local layer spec with megatron_rl's THD attention). A *step* is one
forward + backward of the whole batch as one micro-batch: logits -> ``vocab_parallel_logprobs_entropy`` ->
``loss = -sum(logprob * loss_mask)`` over the response tokens -> backward (no optimizer, no DDP). Variants:

    padded         left-padded [B, S] block, attention mask [B, 1, S, S] (causal AND key is not padding)
    packed         the same rows as one THD stream [1, T] (``data.pack``, alignment 1), block-diagonal causal
    merged+packed  ``merge_stepwise_output`` first (one sequence per trajectory), then packed

All three train on exactly the same loss-masked tokens, so their losses and gradients must agree (checked: it
is the benchmark's sanity check, with the facts that packing allocates fewer slots than padding and merging
fewer tokens than packing). Timings are interleaved (variant order rotates each repetition) in one process after
one warm-up round; the table gives the median and the minimum over repetitions. "Real tokens/s" divides the
real tokens of the *unmerged* rows (``sum_i p_i + r_i``: the batch the trainer receives, the same for all three)
by the step time, so its ratios are the speed-ups.

Peak memory (``--memory subprocess``, the default): one fresh process per variant builds the same model and
batch, runs one warm-up step, releases freed heap to the OS (``malloc_trim``), resets the kernel's peak-RSS
counter (``/proc/self/clear_refs`` = 5), runs one step and reports ``VmHWM - VmRSS`` before the step: the extra
resident memory of a step (activations, autograd state, gradients are already allocated by the warm-up).
Without a writable ``clear_refs`` it falls back to ``ru_maxrss`` minus the RSS before the step (an upper bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.data import (
    GeneratorOutput,
    PackedBatch,
    convert_prompts_responses_to_batch_tensors,
    merge_stepwise_output,
    pack,
    unpack_response,
)

from procmem import release_heap, status_kib
from workloads import (
    print_report_or_exit,
    StepWiseSpec,
    check,
    markdown_table,
    real_tokens,
    stepwise_workload,
    trained_tokens,
)

VOCAB_SIZE = 512
VARIANTS = ("padded", "packed", "merged+packed")
LOSS_RTOL = 1e-4
"""Relative tolerance between the variants' losses / gradient norms (fp32; summation order differs)."""


def tiny_model_config(max_len: int = 4096) -> ModelConfig:
    """The benchmark model: 2 layers, hidden 128, 4 heads / 2 KV groups, SwiGLU 352, vocab 512 (~0.5 M params)."""
    return ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                       num_query_groups=2, vocab_size=VOCAB_SIZE, max_position_embeddings=max_len)  # fmt: skip


_GROUPS: list = []
"""This process's ParallelGroups, created by the first ``build_model``."""


def build_model(model_cfg: ModelConfig, seed: int = 1234) -> torch.nn.Module:
    """A GPTModel on a one-rank gloo group (``initialize_distributed`` runs once per process); weights seeded."""
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.builder import build_gpt_model

    if not _GROUPS:
        _GROUPS.append(initialize_distributed(ParallelConfig(), seed))
    torch.manual_seed(seed)
    return build_gpt_model(model_cfg, ParallelConfig(), _GROUPS[0])


# ---------------------------------------------------------------------- inputs of the three layouts


@dataclass
class PaddedInput:
    """Left-padded block (docs/DESIGN.md section 2)."""

    sequences: torch.Tensor
    """``[B, S]`` int64."""
    mask: torch.Tensor
    """``[B, 1, S, S]`` bool, True = masked (megatron's convention): causal, and padding keys masked."""
    loss_mask: torch.Tensor
    """``[B, R]`` float32, right-aligned."""

    @property
    def slots(self) -> int:
        return self.sequences.numel()

    def to(self, device: torch.device) -> "PaddedInput":
        return PaddedInput(self.sequences.to(device), self.mask.to(device), self.loss_mask.to(device))


@dataclass
class PackedInput:
    """One THD stream (docs/DESIGN.md section 3)."""

    packed: PackedBatch
    """``[1, T]`` stream of the rows."""
    loss_mask: torch.Tensor
    """``[b, R]`` float32, right-aligned."""

    @property
    def slots(self) -> int:
        return self.packed.total_len

    def to(self, device: torch.device) -> "PackedInput":
        return PackedInput(self.packed.to(device), self.loss_mask.to(device))


ModelInput = PaddedInput | PackedInput


def batch_tensors(out: GeneratorOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sequences [B,S], attention_mask [B,S], loss_mask [B,R])`` of the rollouts (library conversion)."""
    sequences, attention_mask, _, _, loss_mask, _ = convert_prompts_responses_to_batch_tensors(
        0, out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"]
    )
    return sequences, attention_mask, loss_mask


def padded_input(sequences: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> PaddedInput:
    width = sequences.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [S, S] query row, key column
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # [B, S, S]
    return PaddedInput(sequences=sequences, mask=~allowed[:, None], loss_mask=loss_mask)


def packed_input(
    sequences: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, align: int = 1
) -> PackedInput:
    return PackedInput(packed=pack(sequences, attention_mask, align), loss_mask=loss_mask)


def variant_inputs(out: GeneratorOutput) -> dict[str, ModelInput]:
    """The three variants of docs/DESIGN.md's layouts for the step-wise rollouts ``out``."""
    tensors = batch_tensors(out)
    merged, _ = merge_stepwise_output(out)
    return {
        "padded": padded_input(*tensors),
        "packed": packed_input(*tensors),
        "merged+packed": packed_input(*batch_tensors(merged)),
    }


# ---------------------------------------------------------------------- one training step


def response_logprobs(model: torch.nn.Module, inp: ModelInput) -> torch.Tensor:
    """``[b, R]`` log-probs of the response tokens, right-aligned, for either layout."""
    from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy

    width = inp.loss_mask.shape[1]
    if isinstance(inp, PaddedInput):
        rows, seq_len = inp.sequences.shape
        positions = torch.arange(seq_len, device=inp.sequences.device)[None].expand(rows, seq_len)  # RoPE is relative: left padding is harmless
        logits = model(inp.sequences, positions, inp.mask)  # [B, S, V]
        logprobs, _ = vocab_parallel_logprobs_entropy(logits[:, :-1], inp.sequences[:, 1:], None, False)
        return logprobs[:, -width:]  # column t predicts token t+1 (docs/DESIGN.md section 2)
    p = inp.packed
    logits = model(p.input_ids, p.position_ids, None, packed_seq_params=p.packed_seq_params())  # [1, T, V]
    logprobs, _ = vocab_parallel_logprobs_entropy(logits, p.labels, None, False)  # [1, T]
    return unpack_response(logprobs, p, width)


def train_step(model: torch.nn.Module, inp: ModelInput) -> tuple[float, float]:
    """Forward + backward of the summed response log-likelihood; returns ``(loss, gradient norm)``."""
    model.zero_grad(set_to_none=True)
    inp = inp.to(next(model.parameters()).device)  # where the model is (a no-op on CPU)
    loss = -(response_logprobs(model, inp) * inp.loss_mask).sum()
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss.detach()), float(grad_norm)


def time_interleaved(
    model: torch.nn.Module, inputs: dict[str, ModelInput], reps: int, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Step times per variant (``reps`` each, order rotated every repetition) and each variant's (loss, norm)."""
    names = list(inputs)
    times: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, tuple[float, float]] = {}
    for rep in range(warmup + reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            start = time.perf_counter()
            results[name] = train_step(model, inputs[name])
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times, results


def check_same_training(results: dict[str, tuple[float, float]]) -> None:
    """Every layout computes the same loss and gradient (the layouts change the work, not the math)."""
    ref_loss, ref_norm = results["padded"]
    for name, (loss, norm) in results.items():
        check(abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"{name} loss {loss} != padded loss {ref_loss}")
        check(abs(norm - ref_norm) <= 10 * LOSS_RTOL * ref_norm, f"{name} grad norm {norm} != padded {ref_norm}")


# ---------------------------------------------------------------------- peak memory


def peak_step_memory(model: torch.nn.Module, inp: ModelInput) -> tuple[float, str]:
    """Extra resident memory (MiB) of one step after a warm-up step, and the method used (module docstring)."""
    train_step(model, inp)
    release_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    baseline = status_kib("VmRSS")
    train_step(model, inp)
    peak = status_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak - baseline) / 1024, method


def memory_in_subprocesses(args: argparse.Namespace) -> dict[str, tuple[float, str]]:
    """One fresh process per variant (``--memory-probe``), run concurrently (memory is per process; this is
    done before the timings so it does not disturb them); returns ``{variant: (MiB, method)}``."""
    probes = {}
    for name in VARIANTS:
        command = [sys.executable, os.path.abspath(__file__), "--memory-probe", name, "--trajectories",
                   str(args.trajectories), "--turns", str(args.turns), "--threads", str(args.threads)]  # fmt: skip
        probes[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = {}
    for name, probe in probes.items():
        stdout, stderr = probe.communicate()
        check(probe.returncode == 0, f"memory probe of {name} failed:\n{stderr[-2000:]}")
        memory[name] = tuple(json.loads(stdout.strip().splitlines()[-1]))
    return memory


# ---------------------------------------------------------------------- the benchmark


def workload(trajectories: int, turns: int) -> GeneratorOutput:
    """The step-wise workload of the model benchmarks (default spec; groups of up to 4 trajectories per prompt)."""
    spec = StepWiseSpec(num_trajectories=trajectories, turns=turns, samples_per_prompt=math.gcd(trajectories, 4),
                        vocab_size=VOCAB_SIZE)  # fmt: skip
    return stepwise_workload(spec)


def run(trajectories: int, turns: int, reps: int, warmup: int = 1,
        memory: dict[str, tuple[float, str]] | None = None) -> dict[str, object]:  # fmt: skip
    """Time the three variants on one model; raises SanityCheckFailed. ``memory`` is added to the report."""
    out = workload(trajectories, turns)
    inputs = variant_inputs(out)
    check(trained_tokens(merge_stepwise_output(out)[0]) == trained_tokens(out), "merge keeps the trained tokens")
    check(inputs["packed"].slots < inputs["padded"].slots, "packing allocates fewer slots than padding")
    check(inputs["merged+packed"].slots < inputs["packed"].slots, "merging packs fewer tokens")
    model = build_model(tiny_model_config())
    times, results = time_interleaved(model, inputs, reps, warmup)
    check_same_training(results)
    real = real_tokens(out)
    header = f"{trajectories} trajectories x {turns} turns = {len(out['uids'])} rows, {real} real tokens"
    return {"times": times, "results": results, "slots": {n: i.slots for n, i in inputs.items()},
            "real_tokens": real, "report": header + "\n\n" + report_table(times, inputs, real, memory)}  # fmt: skip


def report_table(times: dict[str, list[float]], inputs: dict[str, ModelInput], real: int,
                 memory: dict[str, tuple[float, str]] | None) -> str:  # fmt: skip
    base = statistics.median(times["padded"])
    rows = []
    for name, samples in times.items():
        median, best = statistics.median(samples), min(samples)
        row = [name, inputs[name].slots, f"{median:.3f}", f"{best:.3f}", f"{real / median:,.0f}",
               f"{base / median:.2f}x", f"{min(times['padded']) / best:.2f}x"]  # fmt: skip
        if memory is not None:
            row.append(f"{memory[name][0]:.0f}")
        rows.append(row)
    header = ["variant", "token slots", "step s (median)", "step s (min)", "real tokens/s (median)",
              "speed-up vs padded (median)", "speed-up vs padded (min)"]  # fmt: skip
    if memory is not None:
        header.append(f"peak step memory MiB ({next(iter(memory.values()))[1]})")
    return markdown_table(header, rows)


def memory_probe(args: argparse.Namespace) -> None:
    """Child process of ``memory_in_subprocesses``: prints ``[MiB, method]`` as JSON."""
    inp = variant_inputs(workload(args.trajectories, args.turns))[args.memory_probe]
    model = build_model(tiny_model_config())
    print(json.dumps(peak_step_memory(model, inp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per variant (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared 2-core machine)")
    parser.add_argument("--memory", choices=("subprocess", "none"), default="subprocess")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition, no memory probes")
    parser.add_argument("--memory-probe", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        return memory_probe(args)
    if args.quick:
        args.trajectories, args.turns, args.reps, args.memory = 4, 2, 1, "none"
    def run_all() -> dict:
        memory = memory_in_subprocesses(args) if args.memory == "subprocess" else None
        return run(args.trajectories, args.turns, args.reps, memory=memory)

    print_report_or_exit(run_all)


if __name__ == "__main__":
    main()
