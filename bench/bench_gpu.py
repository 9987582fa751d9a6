"""Side-by-side GPU benchmark of the TE-free path against transformers (issue 12).

    python3 bench/bench_gpu.py [--shapes 0.6b 1.7b] [--tokens-per-micro-batch 8192] [--reps 3] [--small]
                               [--json out.json]

Without CUDA it prints that it needs CUDA and exits 0. Per shape (Qwen3 shapes from locally created HF
configs, random weights, bf16, TP1, local layer spec, no downloads):

    ours train    ``MegatronPolicy.forward_backward`` + ``optim_step`` on the whole batch (token-budget
                  micro-batches of ``--tokens-per-micro-batch`` packed tokens)
    ours forward  ``MegatronPolicy.forward`` (response log-probs)
    HF train      transformers' ``Qwen3ForCausalLM`` (sdpa) on the same rows as left-padded micro-batches of
                  the same token budget (rows x width <= budget), forward + backward, no optimizer; log-probs
                  through the same head (``vocab_parallel_logprobs_entropy``) so that only the model differs

Workload: ``workloads.independent_workload`` (anti-correlated prompt/response lengths). Reports real
tokens/s (median over ``--reps`` after one warm-up), MFU against the GPU's dense bf16 peak (model FLOPs:
``6 x matmul params x tokens`` plus causal attention ``6 x L x H x D x sum n_i^2``; forward: a third),
peak GPU memory, and ours/HF ratios. Only the public policy API is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from workloads import IndependentSpec, independent_workload, markdown_table, print_report_or_exit

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
"""Dense bf16 peak by a substring of ``torch.cuda.get_device_name()`` (H200: the same dense peak as H100)."""

SHAPES = {  # Qwen3 configs: hidden, layers, ffn, heads, kv heads (head dim 128, vocab 151,936, tied)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
                 num_key_value_heads=8),
    "small": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2),
}  # fmt: skip
ROWS = {"0.6b": 64, "1.7b": 32, "small": 16}
VOCAB = 151936
HEAD_DIM = 128


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def model_flops(shape: dict, seq_lens: list[int], train: bool) -> float:
    """Matmul FLOPs of one pass over ``seq_lens`` (x3 for forward + backward)."""
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * HEAD_DIM, shape["num_key_value_heads"] * HEAD_DIM
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * ffn) + VOCAB * h  # the output layer's matmul
    forward = 2 * params * sum(seq_lens) + 2 * layers * q * sum(n * n for n in seq_lens)  # causal: half of 4n^2
    return forward * (3 if train else 1)


def hf_config(shape: dict):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, head_dim=HEAD_DIM, tie_word_embeddings=True, max_position_embeddings=40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, **shape)  # fmt: skip


def workload(rows: int, small: bool):
    mean_len = 512 if small else 3600
    spec = IndependentSpec(num_sequences=rows, mean_len=mean_len, jitter=mean_len // 2, vocab_size=VOCAB)
    return independent_workload(spec)


def training_batch(out):
    from megatron_rl.data import convert_prompts_responses_to_batch_tensors
    from megatron_rl.data.batch import TrainingBatch

    sequences, attention_mask, response_mask, rewards, loss_mask, _ = convert_prompts_responses_to_batch_tensors(
        0, out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"])
    advantages = torch.randn(loss_mask.shape, generator=torch.Generator().manual_seed(0))
    tensors = {"sequences": sequences, "attention_mask": attention_mask, "response_mask": response_mask,
               "loss_mask": loss_mask, "rewards": rewards, "advantages": advantages}  # fmt: skip
    n = len(sequences)
    return TrainingBatch(tensors, out["uids"], list(range(n)), [True] * n)


def summed_loss(logprobs, entropy, mb, ctx):
    from megatron_rl.metrics import Metric

    loss = -(logprobs * mb["advantages"].to(logprobs.device) * mb["loss_mask"].to(logprobs.device)).sum()
    return loss, {"loss": Metric(loss.detach(), 1.0, "sum")}


def timed(fn, reps: int) -> tuple[float, float]:
    """(median seconds over ``reps`` after one warm-up, peak GiB allocated during the timed runs)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def run_ours(hf_dir: str, batch, budget: int, reps: int) -> dict[str, tuple[float, float]]:
    from megatron_rl.config import BatchConfig, MegatronRLConfig, ModelConfig, OptimizerConfig
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.hf.config import model_config_from_hf
    from megatron_rl.model.policy import MegatronPolicy

    base = ModelConfig(params_dtype="bfloat16", attention_backend="local")
    config = MegatronRLConfig(model=dataclasses.replace(model_config_from_hf(hf_dir, base), hf_path=None),
                              optimizer=OptimizerConfig(lr=1e-6),
                              batch=BatchConfig(micro_batch_size=None, max_tokens_per_micro_batch=budget))  # fmt: skip
    groups = initialize_distributed(config.parallel, seed=0)
    policy = MegatronPolicy(config, groups)
    try:
        def train():
            policy.forward_backward(batch, summed_loss, None)
            policy.optim_step()

        return {"train": timed(train, reps), "forward": timed(lambda: policy.forward(batch), reps)}
    finally:
        del policy
        destroy_distributed()
        torch.cuda.empty_cache()


def padded_micro_batches(attention_mask: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    """Consecutive rows ``(start, end, width)`` with ``rows x width <= budget`` (width = the longest row)."""
    lens = attention_mask.sum(-1).tolist()
    out, start = [], 0
    while start < len(lens):
        end, width = start + 1, lens[start]
        while end < len(lens) and (end - start + 1) * max(width, lens[end]) <= budget:
            width, end = max(width, lens[end]), end + 1
        out.append((start, end, width))
        start = end
    return out


def run_hf(shape: dict, batch, budget: int, reps: int) -> tuple[float, float]:
    from transformers import Qwen3ForCausalLM

    from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy

    model = Qwen3ForCausalLM._from_config(hf_config(shape), attn_implementation="sdpa", dtype=torch.bfloat16)
    model = model.cuda().train()
    seqs, mask = batch["sequences"].cuda(), batch["attention_mask"].cuda()
    loss_mask, adv = batch["loss_mask"].cuda(), batch["advantages"].cuda()
    width_r = loss_mask.shape[1]

    def train():
        for start, end, width in padded_micro_batches(batch["attention_mask"], budget):
            ids, m = seqs[start:end, -width:], mask[start:end, -width:]
            positions = (m.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=m, position_ids=positions).logits  # [b, w, V] bf16
            lp, _ = vocab_parallel_logprobs_entropy(logits[:, :-1], ids[:, 1:], None, False)
            r = min(width_r, lp.shape[1])
            loss = -(lp[:, -r:] * adv[start:end, -r:] * loss_mask[start:end, -r:]).sum()
            loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        return timed(train, reps)
    finally:
        del model
        torch.cuda.empty_cache()


def bench_shape(name: str, args: argparse.Namespace, peak: float | None) -> dict:
    shape = SHAPES[name]
    rows = args.rows or ROWS[name]
    batch = training_batch(workload(rows, name == "small"))
    seq_lens = batch["attention_mask"].sum(-1).tolist()
    tokens = sum(seq_lens)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf_config(shape).save_pretrained(hf_dir)
        ours = run_ours(hf_dir, batch, args.tokens_per_micro_batch, args.reps)
    hf = run_hf(shape, batch, args.tokens_per_micro_batch, args.reps)
    result = {"shape": name, "rows": rows, "tokens": tokens}
    for label, (seconds, gib), train in (("ours_train", ours["train"], True), ("ours_forward", ours["forward"], False),
                                         ("hf_train", hf, True)):  # fmt: skip
        result[label] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": gib,
                         "mfu": model_flops(shape, seq_lens, train) / seconds / peak if peak else None}  # fmt: skip
    result["train_ratio_vs_hf"] = result["ours_train"]["tokens_per_s"] / result["hf_train"]["tokens_per_s"]
    result["forward_over_train"] = result["ours_forward"]["tokens_per_s"] / result["ours_train"]["tokens_per_s"]
    return result


def report(device: str, results: list[dict]) -> str:
    def fmt(r: dict) -> list[str]:
        return [f"{r['tokens_per_s']:,.0f}", "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %",
                f"{r['peak_gib']:.1f}"]  # fmt: skip

    header = ["shape", "rows / tokens", "ours train tok/s", "MFU", "peak GiB", "HF train tok/s", "MFU", "peak GiB",
              "ratio", "ours forward tok/s", "MFU", "peak GiB", "forward / train"]  # fmt: skip
    rows = [[r["shape"], f"{r['rows']} / {r['tokens']:,}", *fmt(r["ours_train"]), *fmt(r["hf_train"]),
             f"{r['train_ratio_vs_hf']:.2f}", *fmt(r["ours_forward"]), f"{r['forward_over_train']:.2f}"]
            for r in results]  # fmt: skip
    return f"{device}\n\n" + markdown_table(header, rows)


def write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=("0.6b", "1.7b"), default=["0.6b", "1.7b"])
    parser.add_argument("--tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=None, help="rows of the workload (default: per shape)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short rows: a quick check")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu needs CUDA (none available here); nothing measured")
        return 0
    device = torch.cuda.get_device_name()
    shapes = ["small"] if args.small else args.shapes
    if args.small:
        args.reps, args.tokens_per_micro_batch = 1, min(args.tokens_per_micro_batch, 2048)

    def run_all() -> dict:
        results = [bench_shape(name, args, peak_flops(device)) for name in shapes]
        if args.json:
            write_json(args.json, {"device": device, "torch": torch.__version__, "results": results})
        return {"report": report(device, results)}

    print_report_or_exit(run_all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
