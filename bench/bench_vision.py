"""Vision-language training step (Qwen2.5-VL layout): the vision tower's share, and packed against padded.

    .venv/bin/python bench/bench_vision.py [--rows 8] [--reps 3] [--tail 384] [--side 8] [--quick]
    .venv/bin/python bench/bench_vision.py --device cuda     # a GPU (unmeasured here)

Place in the data flow: the "Megatron model" stage (docs/VISION.md). One process, ``initialize_distributed`` (one
rank), then ``model/vision_language.py: build_vision_language_model`` of a small random Qwen2.5-VL made from a
transformers config (language model 4 layers, hidden 256, 8 query / 4 KV heads of 32, SwiGLU 688, vocab 1024,
mrope_section [4, 6, 6]; vision tower 4 blocks of hidden 128 (3 windowed, 1 full), patch 14, 2x2 merge, window 112
pixels, as the real one but narrower). The batch: ``--rows`` rows, each a text prefix, one image of a random size
(4-16 x 4-16 patches of 14 pixels: 4 to 64 image tokens, ``--side``; every third row text only) and a text tail
of random length (16-384 tokens, ``--tail``: RL prompts and responses of any length). A *step* is one forward +
backward of the batch as one micro-batch (``loss = -sum`` of the real tokens' next-token log-probs; no
optimizer). Variants:

    packed   the rows' tokens back to back (THD, ``data/packing.py: pack`` + ``data/mrope.py: vision_pack``): what
             megatron_rl trains on
    padded   every row padded at its END to the longest, the pads counted as tokens (the THD stream with
             ``cu_seqlens`` at multiples of the width): the work of a right-padded ``[B, S]`` batch

Both give the same loss (checked, rel. 1e-4): trailing pads never reach an earlier token. The vision tower sees
the same patches in both (no padding there). Its share: the tower's forward + backward over the batch's images
measured alone (the same images, ``sum`` of its output as the loss), against the whole step. Times are CPU
seconds of the process (one torch thread; the 2-core box is shared, so wall times swing), medians of ``--reps``,
with the least-disturbed wall time beside them; on CUDA, wall seconds after ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.config import ModelConfig, ParallelConfig

from bench_qwen35 import step as qwen35_step
from workloads import markdown_table

VOCAB, IMAGE, START, END, VIDEO = 1024, 1000, 1001, 1002, 1003
PATCH, MERGE, TEMPORAL = 14, 2, 2
LOSS_RTOL = 1e-4


def save_config(path: Path, max_len: int) -> Path:
    """The model's ``config.json`` (no weights: the bench times random ones)."""
    from transformers import Qwen2_5_VLConfig

    Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max_len,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         pad_token_id=0, bos_token_id=None, eos_token_id=2),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                           window_size=112, fullatt_block_indexes=[3], in_chans=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False).save_pretrained(path)  # fmt: skip
    return path


def make_rows(n: int, seed: int, tail: int, side: int) -> list[tuple[list[int], tuple[int, int, int] | None]]:
    """``n`` rows of (tokens, the image's (t, h, w) patch grid or None): a text head of 4-32 tokens, an image of
    4-``2*side`` x 4-``2*side`` patches (every third row none), a text tail of 16-``tail`` tokens."""
    gen = torch.Generator().manual_seed(seed)

    def rand(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def text(k: int) -> list[int]:
        return torch.randint(3, IMAGE, (k,), generator=gen).tolist()

    rows = []
    for i in range(n):
        head, rest = text(rand(4, 32)), text(rand(16, tail))
        if i % 3 == 2:
            rows.append((head + rest, None))
            continue
        grid = (1, 2 * rand(2, side), 2 * rand(2, side))
        rows.append((head + [START] + [IMAGE] * (grid[1] * grid[2] // MERGE**2) + [END] + rest, grid))
    return rows


def step_input(rows, padded: bool, section, device: torch.device) -> dict:
    """The batch as the model's input: the pack (``vision_pack``), targets and weights (1 where a real next
    token is predicted)."""
    from megatron_rl.data.mrope import batch_images, vision_pack
    from megatron_rl.data.packing import pack

    width = max(len(tokens) for tokens, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, real = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (tokens, _) in enumerate(rows):  # right-padded rows: with the pads as tokens, a padded trainer's batch
        ids[i, :len(tokens)], real[i, :len(tokens)] = torch.tensor(tokens), 1
        mask[i] = 1 if padded else real[i]
    gen = torch.Generator().manual_seed(5)
    images = [[(torch.randn(t * h * w, 3 * TEMPORAL * PATCH**2, generator=gen), grid)] if grid else []
              for _, grid in rows for t, h, w in [grid or (0, 0, 0)]]
    pixel_values, image_grid_thw = batch_images(images)
    packed = pack(ids, mask)
    vp = vision_pack(packed, ids, mask, pixel_values, image_grid_thw, image_token_id=IMAGE,
                     spatial_merge_size=MERGE, mrope_section=section)
    is_real = pack(real, mask).input_ids[0].float()  # [T]
    weights = is_real * torch.cat([is_real[1:], is_real[:1] * 0]) * packed.label_mask.flatten()  # real next token
    return {"ids": packed.input_ids.to(device), "pos": packed.position_ids.to(device), "targets":
            packed.labels[0].to(device), "weights": weights.to(device), "params": vp.packed_seq_params(),
            "slots": packed.input_ids.shape[1], "real": int(real.sum())}


def step(model, batch: dict) -> float:
    """Forward + backward (bench_qwen35.py's step over this model's vocabulary); returns the loss."""
    return qwen35_step(model, batch, VOCAB)


def tower_step(model, batch: dict) -> float:
    """The vision tower alone, forward + backward over the batch's images."""
    model.zero_grad(set_to_none=True)
    params = batch["params"]
    out = model.visual(params.pixel_values, grid_thw=params.image_grid_thw)
    out = getattr(out, "pooler_output", out)
    out.sum().backward()
    return 0.0


def timed(fn, device: torch.device) -> tuple[float, float, float]:
    """(CPU s of this process, wall s, fn's result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the other benchmarks' default)")
    parser.add_argument("--tail", type=int, default=384, help="longest text after the image (tokens)")
    parser.add_argument("--side", type=int, default=8, help="largest image side, in pairs of patches (of 14 pixels)")
    parser.add_argument("--quick", action="store_true", help="4 rows, small images and tails, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.reps, args.tail, args.side = 4, 1, 96, 4
    torch.set_num_threads(args.threads)
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.config import load_hf_config, model_config_from_hf
    from megatron_rl.model.vision_language import build_vision_language_model

    parallel = ParallelConfig(device=args.device)
    groups = initialize_distributed(parallel, seed=1234)
    device = groups.device
    rows = make_rows(args.rows, 3, args.tail, args.side)
    hf_dir = save_config(Path(tempfile.mkdtemp(prefix="bench_vision_")), max(len(t) for t, _ in rows) + 64)
    cfg = model_config_from_hf(hf_dir, base=ModelConfig(attention_backend="local"))
    hf_config = load_hf_config(hf_dir)
    torch.manual_seed(1234)
    model = build_vision_language_model(cfg, parallel, groups, hf_config)
    section = hf_config.text_config.rope_parameters["mrope_section"]
    batches = {name: step_input(rows, name == "padded", section, device) for name in ("packed", "padded")}
    runs: dict[str, list] = {name: [] for name in (*batches, "tower")}
    work = {"packed": lambda: step(model, batches["packed"]), "padded": lambda: step(model, batches["padded"]),
            "tower": lambda: tower_step(model, batches["packed"])}
    for fn in work.values():
        fn()  # warm-up
    for rep in range(args.reps):
        for name in (list(work) if rep % 2 == 0 else list(work)[::-1]):
            runs[name].append(timed(work[name], device))
    losses = [runs[name][0][2] for name in batches]
    assert abs(losses[0] - losses[1]) <= LOSS_RTOL * abs(losses[0]), f"the variants' losses differ: {losses}"
    key = 1 if device.type == "cuda" else 0  # CPU: CPU time of this process (the box is shared)
    med = {name: statistics.median(r[key] for r in rs) for name, rs in runs.items()}
    real, images = batches["packed"]["real"], [g for _, g in rows if g]
    print(f"{args.rows} rows, {real} real tokens (longest row {max(len(t) for t, _ in rows)}), {len(images)} images "
          f"({sum(h * w for _, h, w in images)} patches, {sum(h * w for _, h, w in images) // MERGE**2} image tokens), "
          f"{args.reps} reps, device {device}, {torch.get_num_threads()} thread(s); loss {losses[0]:.4f}")
    unit = "wall" if device.type == "cuda" else "CPU"
    table = [[name, batches[name]["slots"], f"{med[name]:.3f}", f"{min(r[1] for r in runs[name]):.3f}",
              f"{real / med[name]:,.0f}", f"{med['padded'] / med[name]:.2f}x",
              f"{med['tower']:.3f} ({100 * med['tower'] / med[name]:.0f} %)"] for name in batches]
    print(markdown_table(["variant", "token slots", f"step {unit} s (median)", "step wall s (min)",
                          f"real tokens / {unit} s", "speed-up vs padded", f"vision tower fwd+bwd {unit} s (share)"],
                         table))


if __name__ == "__main__":
    main()
