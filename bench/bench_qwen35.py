"""Qwen3.5 (hybrid Gated-DeltaNet) training step: packed against padded, and what the fla stand-ins cost.

    .venv/bin/python bench/bench_qwen35.py [--sequences 8] [--low 32] [--high 256] [--reps 3] [--quick]
    .venv/bin/python bench/bench_qwen35.py --device cuda     # GPU with flash-linear-attention (unmeasured here)

Place in the data flow: the "Megatron model" stage (docs/QWEN35.md). One process, ``initialize_distributed``
(one rank) then ``build_gpt_model`` of a tiny Qwen3.5-shaped hybrid (4 layers: GDN, attention, GDN, attention;
hidden 128, 4 query / 2 KV heads of 32, GDN 2 key / 4 value heads of 32, SwiGLU 352, vocab 512). A *step* is one
forward + backward of the batch as one micro-batch (``loss = -sum`` of the real tokens' next-token log-probs; no
optimizer). A GDN layer refuses unpacked input (its state would take in the pads), so both variants are THD:

    packed   the sequences back to back, ``cu_seqlens`` at their lengths (what megatron_rl trains on)
    padded   every sequence padded at its END to the longest, ``cu_seqlens`` at multiples of it: the work of a
             right-padded [B, S] batch (the padding rule allows trailing pads), the layout of padded trainers

Both compute the same loss over the same real tokens (checked, rel. 1e-4). On CPU, megatron's GDN runs through the
P12 stand-ins (``patches/fla_standins.py``), which put each packed sequence in its own batch row padded to the
longest, run megatron's torch chunked delta rule (a Python loop over 64-token chunks) and copy back; the
benchmark times the stand-ins' forward calls and reports the delta rule's padded row slots against the real
tokens. Times are CPU seconds of the process (one torch thread; the 2-core box is shared, so wall times swing by
several x), with the least-disturbed wall time beside them. Memory: the step's peak resident memory above the resident memory before it
(``VmHWM - VmRSS`` after resetting the peak through ``/proc/self/clear_refs``); on CUDA
``torch.cuda.max_memory_allocated`` above the memory before the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_rl.config import ModelConfig, ParallelConfig

from procmem import release_heap, status_kib
from workloads import markdown_table

VOCAB = 512
LOSS_RTOL = 1e-4


def model_config(max_len: int) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
                       kv_channels=32, vocab_size=VOCAB, max_position_embeddings=max_len,
                       linear_attention_freq=[1, 0, 1, 0], linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                       attention_output_gate=True, rotary_percent=0.25, layernorm_zero_centered_gamma=True,
                       qk_layernorm=True, attention_backend="local")  # fmt: skip


def lengths(n: int, seed: int, low: int, high: int) -> list[int]:
    """``n`` sequence lengths, uniform in [low, high] (RL rollouts: a prompt and responses of any length)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


def thd_input(seqs: list[torch.Tensor], width: int | None, device: torch.device) -> dict:
    """One ``[1, T]`` stream: each sequence in a slot of its own length (``width`` None) or of ``width``
    (pads at its end); ``targets [T]`` the next token, ``weights [T]`` 1 where a real next token is predicted."""
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = [width or len(s) for s in seqs]
    total = sum(slots)
    ids = torch.zeros(total, dtype=torch.long)
    pos = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    weights = torch.zeros(total)
    start = 0
    for seq, slot in zip(seqs, slots):
        n = len(seq)
        ids[start:start + n], pos[start:start + slot] = seq, torch.arange(slot)
        targets[start:start + n - 1], weights[start:start + n - 1] = seq[1:], 1.0
        start += slot
    cu = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(slots),
                             max_seqlen_kv=max(slots))
    return {"ids": ids[None].to(device), "pos": pos[None].to(device), "targets": targets.to(device),
            "weights": weights.to(device), "params": params, "slots": total}


def step(model: torch.nn.Module, batch: dict, vocab: int = VOCAB) -> float:
    """Forward + backward of the summed log-prob loss over the first ``vocab`` logits; returns the loss."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["ids"], batch["pos"], None, packed_seq_params=batch["params"])[0, :, :vocab].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None])[:, 0]  # [T]
    loss = -(logprobs * batch["weights"]).sum()
    loss.backward()
    return float(loss.detach())


class StandInClock:
    """Seconds spent in the stand-ins' forward calls (``causal_conv1d``, ``chunk_gated_delta_rule``) and the
    row slots the delta rule ran on in one layer (``n`` rows of the longest sequence)."""

    def __init__(self) -> None:
        from megatron.core.ssm.gated_delta_net import gdn  # the P12 stand-ins, installed by initialize_distributed

        self.seconds, self.rule_slots = 0.0, 0
        for name in ("causal_conv1d", "chunk_gated_delta_rule"):
            setattr(gdn, name, self._timed(getattr(gdn, name), name == "chunk_gated_delta_rule"))

    def _timed(self, fn, is_rule: bool):
        def timed(*args, **kwargs):
            cu = kwargs.get("cu_seqlens")
            if is_rule and cu is not None:
                sizes = (cu[1:] - cu[:-1]).tolist()
                self.rule_slots = len(sizes) * max(sizes)  # the same in every GDN layer
            started = time.process_time()
            out = fn(*args, **kwargs)
            self.seconds += time.process_time() - started
            return out

        return timed


def measure(model, batch, device, clock) -> dict:
    """One step: CPU s (this process), wall s, stand-in forward CPU s, loss, delta-rule row slots of one layer,
    step memory MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        release_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kib("VmRSS") * 1024
    if clock is not None:
        clock.seconds, clock.rule_slots = 0.0, 0
    wall, cpu = time.perf_counter(), time.process_time()
    loss = step(model, batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else status_kib("VmHWM") * 1024
    return {"cpu": cpu, "wall": wall, "rule": clock.seconds if clock else float("nan"), "loss": loss,
            "slots": clock.rule_slots if clock else 0, "mib": (peak - before) / 2**20}


def delta_rule_cost(lengths_: list[int], cfg: ModelConfig, reps: int) -> tuple[float, float]:
    """CPU s of one GDN layer's delta rule, forward + backward, over sequences of ``lengths_``: (the stand-in on
    the packed stream, each sequence in a row padded to the longest; megatron's torch rule called once per
    sequence at its own length, the work a varlen kernel does). Medians over ``reps``."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator().manual_seed(11)
    total = sum(lengths_)

    def inputs(n: int) -> list[torch.Tensor]:
        q, k = (torch.nn.functional.normalize(torch.randn(1, n, heads, dk, generator=gen), dim=-1) for _ in "qk")
        v = torch.randn(1, n, heads, dv, generator=gen)
        g, beta = -torch.rand(1, n, heads, generator=gen), torch.rand(1, n, heads, generator=gen)
        return [t.requires_grad_() for t in (q, k, v, g, beta)]

    def timed(fn) -> float:
        runs = []
        for _ in range(reps):
            started = time.process_time()
            fn()
            runs.append(time.process_time() - started)
        return statistics.median(runs)

    cu = torch.tensor([0, *torch.tensor(lengths_).cumsum(0).tolist()], dtype=torch.int32)
    packed = inputs(total)
    standin = timed(lambda: gdn.chunk_gated_delta_rule(*packed, cu_seqlens=cu)[0].sum().backward())
    singles = [inputs(n) for n in lengths_]
    own = timed(lambda: [common.torch_chunk_gated_delta_rule(*t)[0].sum().backward() for t in singles])
    return standin, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--low", type=int, default=32)
    parser.add_argument("--high", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the other benchmarks' default)")
    parser.add_argument("--quick", action="store_true", help="4 sequences of 16-128 tokens, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.low, args.high, args.reps = 4, 16, 128, 1
    torch.set_num_threads(args.threads)
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.builder import build_gpt_model

    groups = initialize_distributed(ParallelConfig(device=args.device), seed=1234)
    device = groups.device
    clock = StandInClock() if device.type == "cpu" else None  # before the build: each layer binds the rule then
    torch.manual_seed(1234)
    model = build_gpt_model(model_config(args.high), ParallelConfig(device=args.device), groups)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths(args.sequences, 3, args.low, args.high)]
    real = sum(len(s) for s in seqs)
    batches = {"packed": thd_input(seqs, None, device), "padded": thd_input(seqs, max(map(len, seqs)), device)}
    for batch in batches.values():
        step(model, batch)  # warm-up
    results: dict[str, list] = {name: [] for name in batches}
    for rep in range(args.reps):
        for name in (list(batches) if rep % 2 == 0 else list(batches)[::-1]):
            results[name].append(measure(model, batches[name], device, clock))
    losses = [runs[0]["loss"] for runs in results.values()]
    assert abs(losses[0] - losses[1]) <= LOSS_RTOL * abs(losses[0]), f"the variants' losses differ: {losses}"
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("cpu", "wall", "rule", "mib")}
           for name, runs in results.items()}
    clock_key = "wall" if device.type == "cuda" else "cpu"  # CPU: CPU time of this process (the box is shared)
    rows = [[name, batches[name]["slots"], f"{m['cpu']:.3f}", f"{min(r['wall'] for r in results[name]):.3f}",
             f"{real / m[clock_key]:,.0f}", f"{med['padded'][clock_key] / m[clock_key]:.2f}x",
             f"{m['rule']:.3f} ({100 * m['rule'] / m['cpu']:.0f}%)", f"{results[name][0]['slots'] / real:.2f}x",
             f"{m['mib']:.0f}"] for name, m in med.items()]
    print(f"{args.sequences} sequences, {real} real tokens (lengths {args.low}-{args.high}, longest "
          f"{max(map(len, seqs))}), {args.reps} reps, device {device}, {torch.get_num_threads()} thread(s)")
    if device.type == "cpu":
        standin, own = delta_rule_cost([len(s) for s in seqs], model_config(args.high), args.reps)
        print(f"one GDN layer's delta rule, fwd+bwd, CPU s: stand-in (rows padded to the longest) {standin:.3f}, "
              f"per sequence at its own length {own:.3f} ({standin / own:.2f}x)")
    print(markdown_table(["variant", "token slots", "step CPU s (median)", "step wall s (min)",
                          f"real tokens / {clock_key} s", "speed-up vs padded",
                          "stand-in fwd CPU s (share of step)", "delta-rule row slots / real tokens",
                          "step memory MiB"], rows))


if __name__ == "__main__":
    main()
