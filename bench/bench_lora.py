"""LoRA against full fine-tuning: bytes of trainable state, peak step memory, and what a weight sync moves.

    .venv/bin/python bench/bench_lora.py [--models mid 0.6b] [--ranks 8 16 64] [--small]
    .venv/bin/python bench/bench_lora.py --device cuda --models 1.7b         # a GPU (not run: none lent here)
    .venv/bin/python bench/bench_lora.py --device cuda --models 8b --skip-full

Place in the data flow: ``model.lora.rank`` (docs/LORA.md) changes three things this measures, per model shape,
side by side in one run: the trainer's state (only the adapters have gradients and Adam moments), the memory of
one RL step, and the weight sync into vLLM (``VLLMEngine._sync``: the merged model's HF tensors for a full fine-tune,
the peft adapter alone with LoRA).

Models: random Qwen3 HF folders made locally (``AutoModelForCausalLM.from_config``, fp32, no downloads): ``mid``
(hidden 768, 12 layers, ffn 2048, 12 heads / 4 KV heads, head_dim 64, vocab 32000, tied: ~100M) and ``0.6b`` (the
Qwen3-0.6B shape: hidden 1024, 28 layers, ffn 3072, 16 / 8 heads, head_dim 128, vocab 151936, tied). ``--small``:
``tiny`` only (2 layers, hidden 64: a smoke run of the script). Variants: full fine-tuning, LoRA r=8/16/64 (alpha =
2r, all 7 projections), fp32, Adam, one process (gloo, CPU), each variant in a fresh spawned process (so its memory
goes back); the order of the variants is the command line's.

``1.7b`` and ``8b`` (Qwen3-1.7B / -8B shapes) are for ``--device cuda`` (not run: no GPU lent here; on a GPU the
two memory columns are device memory).

Per variant: build the policy from the HF folder; 2 RL steps (``Trainer.train_step``) on one fixed batch of 4
sequences x (16 prompt + 16 response) tokens (GRPO, 2 groups of 2; the first step allocates Adam's state). Reported:
- trainable state: the bytes of trainable parameters + their gradients (the DDP grad buffer, ``main_grad``) +
  the optimizer's state (every tensor in Adam's state), after step 2;
- step 2: its seconds, and its peak RSS above the RSS just before it (after ``malloc_trim``; a 2 ms sampler,
  so a lower bound) and the process's peak RSS (VmHWM) over the whole run;
- weight sync: bytes and seconds of what the sender prepares each sync: the full fine-tune's HF tensors
  (``iter_stage_hf_weights`` run to the end: mbridge's conversion) or the adapter's peft tensors
  (``peft_adapter_tensors``). The transfer itself (gloo into one engine) is bytes / the bandwidth of BENCHMARKS.md
  section 8; no engine is started here.
Sanity checks (non-zero exit): a LoRA run's trainable parameters are the adapters exactly (r * (in + out) per
projection, from the HF config), the step's metrics are finite, and the full run's sync bytes equal the HF model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
from bench_weight_sync import MODELS as SYNC_MODELS  # noqa: E402
from procmem import release_heap, status_kib  # noqa: E402

MIB = 2**20
MODELS = {
    **SYNC_MODELS,  # tiny, mid, 0.6b: the shapes of bench_weight_sync.py
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip
PROMPT, RESPONSE = 16, 16


def write_model(path: Path, name: str) -> Path:
    """The random HF folder of ``name`` (made once; the tokenizer files are not needed: ids go in directly)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (path / "done").exists():
        cfg = AutoConfig.for_model("qwen3", max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=0,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **MODELS[name])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        (path / "done").write_text("")
    return path


def expected_adapter_params(name: str, rank: int) -> int:
    """r * (in + out) per projection and layer (q, k, v, o, gate, up, down), from the HF shape."""
    m = MODELS[name]
    h, f, q, kv = m["hidden_size"], m["intermediate_size"], m["num_attention_heads"] * m["head_dim"], \
        m["num_key_value_heads"] * m["head_dim"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
    return rank * per_layer * m["num_hidden_layers"]


def batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(2) for _ in range(2)]
    responses = [torch.randint(3, vocab, (RESPONSE,), generator=g).tolist() for _ in prompts]
    return {"prompt_token_ids": prompts, "response_ids": responses, "rewards": [1.0, 0.0, 0.0, 1.0],
            "loss_masks": [[1] * RESPONSE for _ in prompts], "uids": [0, 0, 1, 1]}


def optimizer_state_bytes(optimizer) -> int:
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


class PeakRss:
    """Peak VmRSS (KiB) of this process, sampled every 2 ms in a thread while active."""

    def __enter__(self) -> "PeakRss":
        self.peak, self.stop = status_kib("VmRSS"), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, status_kib("VmRSS"))
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def run_variant(hf_dir: str, name: str, rank: int, port: int, out: str, device: str) -> None:
    """One variant in this (spawned) process; writes its row as JSON to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf import policy_from_hf
    from megatron_rl.hf.lora import peft_adapter_tensors
    from megatron_rl.hf.weights import iter_stage_hf_weights
    from megatron_rl.trainer import Trainer

    lora = [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}"] if rank else []
    cfg = load_config(None, [f"parallel.device={device}", "optimizer.lr=1e-5", "optimizer.lr_warmup_steps=0",
                             "batch.train_batch_size=2", "batch.policy_mini_batch_size=2",
                             "algorithm.advantage_estimator=grpo", *lora], world_size=1)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = policy_from_hf(cfg, groups, hf_dir=hf_dir, pad_token_id=0)
    trainer = Trainer(policy.config, policy)
    data = batch(MODELS[name]["vocab_size"])
    metrics = trainer.train_step(data)
    release_heap()
    before = status_kib("VmRSS")
    cuda = device == "cuda"
    if cuda:  # device memory instead of RSS: the step's peak above what is allocated before it
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before_dev = torch.cuda.memory_allocated()
    started = time.perf_counter()
    with PeakRss() as peak:
        metrics = trainer.train_step(data)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - started
    trainable = [p for p in policy.module.parameters() if p.requires_grad]
    params = sum(p.numel() for p in trainable)
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in trainable if getattr(p, "main_grad", None)
                is not None)
    started = time.perf_counter()
    if rank:
        sync_bytes = sum(t.numel() * t.element_size() for t in peft_adapter_tensors(policy.module, groups).values())
    else:
        stream = iter_stage_hf_weights([policy.module], hf_dir, groups)
        sync_bytes = sum(t.numel() * t.element_size() for _, t in stream)
    sync_s = time.perf_counter() - started
    total = sum(p.numel() for p in policy.module.parameters())
    row = {
        "model": name, "variant": f"LoRA r={rank}" if rank else "full", "rank": rank, "params": total,
        "trainable_params": params, "param_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "grad_bytes": grads, "optimizer_bytes": optimizer_state_bytes(policy.optimizer), "step_s": step_s,
        "step_peak_extra_mib": ((torch.cuda.max_memory_allocated() - before_dev) / MIB if cuda
                                else (peak.peak - before) / 1024),
        "process_peak_mib": torch.cuda.max_memory_allocated() / MIB if cuda else status_kib("VmHWM") / 1024,
        "sync_bytes": sync_bytes, "sync_prepare_s": sync_s,
        "finite": all(v == v and abs(v) != float("inf") for v in metrics.values() if isinstance(v, float)),
    }  # fmt: skip
    row["trainable_state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    Path(out).write_text(json.dumps(row))


def measure(hf_dir: Path, name: str, rank: int, work: Path, device: str) -> dict:
    from multiprocessing import get_context

    from megatron_rl.inference.vllm.server import free_port

    out = work / f"{name}_r{rank}.json"
    args = (str(hf_dir), name, rank, free_port(), str(out), device)
    proc = get_context("spawn").Process(target=run_variant, args=args)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"bench_lora: {name} rank {rank} failed (exit code {proc.exitcode})")
    row = json.loads(out.read_text())
    if rank and row["trainable_params"] != expected_adapter_params(name, rank):
        raise SystemExit(f"bench_lora: {name} r={rank} trains {row['trainable_params']} parameters, expected "
                         f"{expected_adapter_params(name, rank)} (the adapters)")
    if not rank and row["sync_bytes"] != hf_bytes(hf_dir):
        raise SystemExit(f"bench_lora: {name}: the full sync prepared {row['sync_bytes']} bytes, the HF model has "
                         f"{hf_bytes(hf_dir)}")
    if not row["finite"]:
        raise SystemExit(f"bench_lora: {name} rank {rank}: a metric of the step is not finite")
    return row


def hf_bytes(hf_dir: Path) -> int:
    """Bytes of the tensors of an HF folder (from the safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for file in hf_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                total += int(torch.tensor(piece.get_shape()).prod()) * 4  # fp32
    return total


def table(rows: list[dict]) -> str:
    head = ("| model | variant | trainable params | trainable state MiB (params+grads+Adam) | vs full | step s | "
            "step peak extra MiB | process peak MiB | sync MiB | vs full | sync prepare s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    full = {r["model"]: r for r in rows if not r["rank"]}
    for r in rows:
        f = full.get(r["model"])
        ratio = lambda key: f"{f[key] / r[key]:.0f}x smaller" if f and r["rank"] else "-"  # noqa: E731
        lines.append(f"| {r['model']} | {r['variant']} | {r['trainable_params'] / 1e6:.2f}M | "
                     f"{r['trainable_state_bytes'] / MIB:.1f} | {ratio('trainable_state_bytes')} | {r['step_s']:.2f} | "
                     f"{r['step_peak_extra_mib']:.0f} | {r['process_peak_mib']:.0f} | {r['sync_bytes'] / MIB:.2f} | "
                     f"{ratio('sync_bytes')} | {r['sync_prepare_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mid", "0.6b"], choices=sorted(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 64])
    parser.add_argument("--small", action="store_true", help="tiny model, r=8 and full: a smoke run")
    parser.add_argument("--work", default="/tmp/megatron_rl_bench_lora")
    parser.add_argument("--skip-full", action="store_true",
                        help="LoRA variants only (8b in fp32: full fine-tuning's ~120 GiB of state fit no one GPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: memory columns are device memory (torch.cuda.max_memory_allocated)")
    args = parser.parse_args(argv)
    models, ranks = (["tiny"], [8]) if args.small else (args.models, args.ranks)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in models:
        hf_dir = write_model(work / name, name)
        for rank in ([] if args.skip_full else [0]) + ranks:
            rows.append(measure(hf_dir, name, rank, work, args.device))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
