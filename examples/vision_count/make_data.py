"""Write the image demo's data: generated pictures of 1 to 4 white squares on black, and prompts asking how many.

    python examples/vision_count/make_data.py outputs/vision_count_data [--train 256 --val 40 --seed 0]

writes ``images/*.png`` (32 x 32 pixels) and ``train.jsonl`` / ``val.jsonl`` (the val pictures are other random
layouts, 1 to 4 squares equally often) with rows::

    {"prompt": "<|vision_start|><|image_pad|><|vision_end|> how many squares ?", "images": ["images/train_0.png"],
     "answer": "three", "count": 3}

(image paths relative to the JSONL file's folder: the main job looks them up there). Each square is 6 x 6 pixels
in its own cell of a 4 x 4 grid of 8 x 8 cells, shifted by 0 to 2 pixels in each direction: the tiny model's tower
sees the picture as 4 x 4 merged tokens of 8 x 8 pixels, so counting is counting bright tokens, which a random
2-layer model learns from the reward in 150 steps (on 2 of 3 seeds fully or mostly: BENCHMARKS.md section 16).
"""

from __future__ import annotations

import argparse
import io
import json
import random
from collections.abc import Sequence
from pathlib import Path

NUMBERS = ["one", "two", "three", "four"]
PROMPT = "<|vision_start|><|image_pad|><|vision_end|> how many squares ?"  # make_model.IMAGE, then the question
SIDE, CELL, SQUARE = 32, 8, 6


def squares_png(corners: Sequence[tuple[int, int]], size: int = SIDE, square: int = SQUARE) -> bytes:
    """A ``size`` x ``size`` PNG, black, with a white ``square`` x ``square`` square at each ``(x, y)`` corner."""
    from PIL import Image

    image = Image.new("RGB", (size, size))
    for x, y in corners:
        image.paste((255, 255, 255), (x, y, x + square, y + square))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def random_corners(count: int, rng: random.Random) -> list[tuple[int, int]]:
    """``count`` squares' corners: distinct random cells of the grid, each shifted by 0 to CELL - SQUARE pixels."""
    cells = rng.sample(range((SIDE // CELL) ** 2), count)
    slack = CELL - SQUARE
    return [(c % (SIDE // CELL) * CELL + rng.randint(0, slack), c // (SIDE // CELL) * CELL + rng.randint(0, slack))
            for c in cells]


def write_split(out_dir: Path, split: str, rows: int, rng: random.Random) -> Path:
    """``rows`` pictures (counts 1-4 in turn, then shuffled) under ``out_dir/images`` and ``out_dir/<split>.jsonl``."""
    counts = [1 + i % len(NUMBERS) for i in range(rows)]
    rng.shuffle(counts)
    lines = []
    for i, count in enumerate(counts):
        image = Path("images") / f"{split}_{i}.png"
        (out_dir / image).write_bytes(squares_png(random_corners(count, rng)))
        row = {"prompt": PROMPT, "images": [str(image)], "answer": NUMBERS[count - 1], "count": count}
        lines.append(json.dumps(row) + "\n")
    path = out_dir / f"{split}.jsonl"
    path.write_text("".join(lines))
    return path


def make_data(out_dir: Path, train: int = 256, val: int = 40, seed: int = 0) -> dict[str, Path]:
    """The train and val files (and their pictures) under ``out_dir``."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    return {split: write_split(out_dir, split, rows, rng) for split, rows in (("train", train), ("val", val))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the pictures and JSONL files into (created)")
    parser.add_argument("--train", type=int, default=256, help="training rows")
    parser.add_argument("--val", type=int, default=40, help="held-out rows (greedy evaluation)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pictures' layouts")
    args = parser.parse_args()
    files = make_data(Path(args.out_dir), args.train, args.val, args.seed)
    print("written:", ", ".join(str(p) for p in files.values()))
