"""Write the digit game's tiny random Qwen3 and its 16-word tokenizer into a folder (no downloads):
``<pad> <unk> <eos> ? + - 0..9``, the built-in game's vocabulary (its ``<bos>`` is ``<unk>`` here, unused), and
the arithmetic example's shapes (examples/arithmetic/make_model.py).

    python examples/digit_game/make_model.py outputs/digit_game_model [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

WORDS = ["?", "+", "-", *(str(d) for d in range(10))]


def make_model(path: Path, seed: int = 0) -> Path:
    spec = importlib.util.spec_from_file_location("arithmetic_make_model",
                                                  Path(__file__).resolve().parents[1] / "arithmetic" / "make_model.py")
    arithmetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arithmetic)
    return arithmetic.make_model(path, seed, words=WORDS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the checkpoint into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialization")
    args = parser.parse_args()
    print(f"tiny Qwen3 for the digit game written to {make_model(Path(args.out_dir), args.seed)}")
