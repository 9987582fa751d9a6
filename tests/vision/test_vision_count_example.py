"""The image demo's files agree with each other (examples/vision_count, configs/vision_count_cpu.yaml), without
Megatron (one process, ~3 s CPU): the model, tokenizer and image processor that make_model.py writes load in
transformers; make_data.py's rows, through the shipped config's single_turn environment, become the 16 image
tokens of a 32 x 32 picture and the question, none left out, train and val; each picture holds its ``count``
squares; reward.py gives 1 to the count's word only. The demo's learning run (several minutes, 2 ranks) is in
BENCHMARKS.md section 16, not in the suite; the main job on image prompts is tests/vision/test_vl_job.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.job_run import ROOT, example_module

CONFIG = ROOT / "configs" / "vision_count_cpu.yaml"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("vision_count")
    model = example_module("examples/vision_count/make_model.py").make_model(path / "model", seed=0)
    files = example_module("examples/vision_count/make_data.py").make_data(path / "data", train=8, val=4, seed=1)
    return {"model": model, **files}


def test_the_shipped_config_reads_the_example_s_model_data_and_reward(example):
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from megatron_rl.environments.registry import make_environment
    from megatron_rl.job.config import load_job_config

    cfg = load_job_config(CONFIG, [f"model.hf_path={example['model']}", f"data.train_files={example['train']}",
                                   f"data.val_files={example['val']}"])
    assert cfg.data.image_key == "images" and cfg.eval.interval > 0
    env = make_environment(cfg)
    assert len(env.train.kept) == 8 and len(env.val.kept) == 4 and not env.train.failed and not env.val.failed
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(example["model"])
    tok = AutoTokenizer.from_pretrained(example["model"])
    question = tok("how many squares ?", add_special_tokens=False)["input_ids"]
    image = [hf.config.vision_start_token_id] + [hf.config.image_token_id] * 16 + [hf.config.vision_end_token_id]
    assert all(p.token_ids == image + question for p in env.train.kept + env.val.kept)  # 32 x 32: 4 x 4 tokens
    assert tok.unk_token_id not in question and len(tok) == hf.config.text_config.vocab_size

    make_data = example_module("examples/vision_count/make_data.py")
    for line in example["train"].read_text().splitlines():
        row = json.loads(line)
        pixels = np.asarray(Image.open(example["train"].parent / row["images"][0]))
        assert (pixels[..., 0] > 0).sum() == row["count"] * make_data.SQUARE**2 and row["answer"] == \
            make_data.NUMBERS[row["count"] - 1]
    reward = example_module("examples/vision_count/reward.py").reward
    assert [reward(prompt="", response=r, answer="two")["reward"] for r in ("two", "two two", "three", "")] == \
        [1.0, 0.5, 0.0, 0.0]
