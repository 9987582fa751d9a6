"""A vision-language task for the main job's tests (tests/vision/test_vl_environment.py, test_vl_job.py): the tiny
Qwen2.5-VL of tests/support/qwen2_5_vl_tiny.py, a JSONL of prompts with generated PNG images ("how many squares":
each image holds 1 to 3 white squares on black, its ``count`` column says how many; the pictures of the image demo
examples/vision_count, smaller), a row whose image is missing
and a reward that varies with the sample (so every GRPO group has a gradient)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tests.support import qwen2_5_vl_tiny as tiny
from tests.support.job_run import example_module

IMAGE = tiny.IMAGE

REWARD = ("def count_reward(prompt, response, images, count):\n"
          "    return -abs(len(response.split()) - count)\n")


def squares_png(count: int) -> bytes:
    """A 16 x 16 PNG with ``count`` white 4x4 squares on black, along the diagonal (the image demo's picture
    maker, examples/vision_count/make_data.py)."""
    make_data = example_module("examples/vision_count/make_data.py")
    return make_data.squares_png([(4 * k, 4 * k) for k in range(count)], size=16, square=4)


def make_task(path: Path, head_dim: int = 16) -> dict[str, Path]:
    """The checkpoint, prompts.jsonl (5 rows with images: paths, one relative to the file's folder, a data URL; and
    one whose image is missing)
    and the reward file, under ``path``."""
    model = tiny.save_checkpoint(path / "model", head_dim=head_dim)  # 32: for vLLM
    rows = []
    for i, count in enumerate([1, 2, 3, 2, 1]):
        image = path / f"squares_{i}.png"
        image.write_bytes(squares_png(count))
        ref = {1: image.name,  # relative to the prompt file's folder
               3: "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()}.get(i, str(image))
        rows.append({"prompt": f"t5 {IMAGE} t6 t7", "images": [ref], "count": count})
    rows.insert(2, {"prompt": f"t5 {IMAGE} t6 t7", "images": [str(path / "missing.png")], "count": 1})
    (path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "count_reward.py").write_text(REWARD)
    return {"model": model, "data": path / "prompts.jsonl", "reward": path / "count_reward.py"}


def overrides(task: dict[str, Path]) -> list[str]:
    return [f"model.hf_path={task['model']}", f"data.train_files={task['data']}", "data.image_key=images",
            f"reward.function={task['reward']}:count_reward"]
