"""The built-in engine with images: decoding through the KV cache against full forwards (docs/VISION.md section 8).

    .venv/bin/python bench/bench_vision_decode.py [--prompts 8] [--samples 8] [--tokens 2 16 64] [--reps 3]

Place in the data flow: the rollout stage with ``rollout.engine=builtin`` and ``data.image_key`` (the image demo,
``configs/vision_count_cpu.yaml``). The model is the demo's (``examples/vision_count/make_model.py``: a tiny random
Qwen2.5-VL, written to a temporary folder), the prompts its own ("<image> how many squares ?" with a 32 x 32
picture of 1-4 squares: 16 image tokens, 22 prompt tokens), ``--prompts`` pictures x ``--samples`` samples each
(a GRPO group shares its images object, as the environment gives them). For each response length of ``--tokens``
(no stop token: every row decodes that many), one ``BuiltinEngine.generate`` per path, the same seed:

    full     ``from_policy(kv_cache=False)``: each step a forward over every distinct context with its images
             (a group's rows once), the vision tower included: what the engine did before the cache took images
    cached   ``from_policy()``: the prompts and their images prefilled once (the tower once per row), then one
             token per row per step through ``model/kv_cache.py`` at its 3-D position (cached length + rope delta)

Checked: both paths sample the same tokens (else the run fails). Times: CPU seconds of the process (one torch
thread; the 2-core box is shared, so wall times swing), median of ``--reps``, with the wall time beside them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def demo_policy(folder: Path):
    """The demo's model written to ``folder`` and its ``VisionLanguagePolicy`` (fp32, one rank)."""
    sys.path.insert(0, str(ROOT / "examples" / "vision_count"))
    from make_model import make_model

    from megatron_rl.config import MegatronRLConfig, ModelConfig, ParallelConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.weights import policy_from_hf

    make_model(folder)
    groups = initialize_distributed(ParallelConfig(device="cpu"), seed=0)
    config = MegatronRLConfig(model=ModelConfig(attention_backend="local"))
    return policy_from_hf(config, groups, hf_dir=folder)


def demo_prompts(folder: Path, prompts: int, samples: int) -> tuple[list[list[int]], list]:
    """``prompts`` pictures' prompts, each ``samples`` times, and their images (one object per group)."""
    sys.path.insert(0, str(ROOT / "examples" / "vision_count"))
    from make_data import PROMPT, random_corners, squares_png

    from megatron_rl.data.images import ImageEncoder, read_image

    encoder = ImageEncoder.from_checkpoint(folder)
    rng = random.Random(0)
    ids, images = [], []
    for i in range(prompts):
        png = folder / f"picture_{i}.png"
        png.write_bytes(squares_png(random_corners(1 + i % 4, rng)))
        tokens, pixels, grids = encoder.encode(PROMPT, [read_image(str(png))])
        group_images = list(zip(torch.split(pixels, grids.prod(-1).tolist()), [tuple(g) for g in grids.tolist()]))
        ids += [tokens] * samples
        images += [group_images] * samples
    return ids, images


def timed(engine, prompts, images, tokens: int) -> tuple[float, float, list[list[int]]]:
    from megatron_rl.inference.engine import SamplingSpec

    spec = SamplingSpec(max_tokens=tokens, temperature=1.0, stop_token_ids=())
    cpu, wall = time.process_time(), time.perf_counter()
    out = engine.generate(prompts, spec, seed=1, images=images)
    return time.process_time() - cpu, time.perf_counter() - wall, [c.token_ids for c in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron_rl.inference.builtin_engine import BuiltinEngine

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "vision_count_model"
        policy = demo_policy(folder)
        prompts, images = demo_prompts(folder, args.prompts, args.samples)
        engines = {"full": BuiltinEngine.from_policy(policy, 0, kv_cache=False),
                   "cached": BuiltinEngine.from_policy(policy, 0)}
        assert engines["cached"].decoder is not None and engines["full"].decoder is None
        print(f"{len(prompts)} rows ({args.prompts} pictures x {args.samples} samples), prompt {len(prompts[0])} "
              f"tokens; CPU s (median of {args.reps}) / wall s")
        print(f"{'tokens':>6} {'full CPU':>9} {'wall':>6} {'cached CPU':>10} {'wall':>6} {'speed-up':>8}")
        for tokens in args.tokens:
            runs = {name: [timed(engine, prompts, images, tokens) for _ in range(args.reps)]
                    for name, engine in engines.items()}
            if runs["full"][0][2] != runs["cached"][0][2]:
                raise SystemExit(f"{tokens} tokens: the cached path sampled other tokens than the full forwards")
            cpu = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
            wall = {name: min(r[1] for r in rs) for name, rs in runs.items()}
            print(f"{tokens:>6} {cpu['full']:>9.2f} {wall['full']:>6.2f} {cpu['cached']:>10.2f} "
                  f"{wall['cached']:>6.2f} {cpu['full'] / cpu['cached']:>7.1f}x")


if __name__ == "__main__":
    main()
