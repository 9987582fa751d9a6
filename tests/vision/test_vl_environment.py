"""``data.image_key`` wiring without Megatron (one process, ~3 s CPU): the single_turn environment of a VL job config
encodes the rows' images with the checkpoint's processor and leaves out (counts, names) a row whose image is
missing; its rollouts carry each prompt's images to the engine and in ``GeneratorOutput['images']``, which the
trainer's batch turns into ``pixel_values`` / ``image_grid_thw``; ``data.image_key`` with a text checkpoint, with
a step-API environment is one ConfigError at start-up; the vLLM engine takes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.environments.registry import make_environment
from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs
from megatron_rl.inference.engine import SamplingSpec
from megatron_rl.job.config import load_job_config
from tests.support import qwen2_5_vl_tiny as tiny
from tests.vision.vl_task import make_task, overrides

BASE = Path(__file__).resolve().parents[2] / "configs" / "user_job.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("vl_task"))


def _config(task, *extra: str):
    return load_job_config(BASE, [*overrides(task), *extra])


def test_rollouts_carry_the_rows_images(task):
    env = make_environment(_config(task, f"data.val_files={task['data']}"))
    assert [p.row for p in env.train.kept] == [0, 1, 3, 4, 5] and [row for row, _ in env.train.failed] == [2]
    assert "missing.png" in env.train.failed[0][1] and "1 train rows left out" in env.describe()
    image_tokens = [tiny.VISION_START] + [tiny.IMAGE_TOKEN] * 4 + [tiny.VISION_END]  # 16 x 16 pixels, patch 4, 2x2
    assert all(p.token_ids == [5, *image_tokens, 6, 7] for p in env.train.kept)

    seen = []

    def image_logprobs(contexts, images):  # the engine's view: each row's images, one image of 16 patches
        seen.append(images)
        return uniform_next_token_logprobs(tiny.VOCAB)(contexts)

    engine = BuiltinEngine(uniform_next_token_logprobs(tiny.VOCAB), image_logprobs=image_logprobs)
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=(2,))
    rollouts = env.rollout(engine, spec, num_prompts=2, n_samples_per_prompt=2, seed=0, step_wise=False)
    images = rollouts.output["images"]
    assert len(images) == 4 and images[0] is images[1] and images[2] is images[3]  # a group shares its images
    assert [grid for row in images for _, grid in row] == [(1, 4, 4)] * 4 and seen[0][0] is images[0]
    assert rollouts.metrics["data/failed_image_rows"] == 1

    evaluation = env.evaluate(engine, spec, seed=1, num_prompts=3, pass_threshold=-1.0)
    assert len(evaluation.samples) == 3 and [grid for _, grid in seen[-1][0]] == [(1, 4, 4)]  # held-out: images too

    batch = TrainingBatch.from_generator_output(rollouts.output, pad_token_id=0)
    assert batch["pixel_values"].shape == (4, 16, images[0][0][0].shape[1])
    assert torch.equal(batch["pixel_values"][2], images[2][0][0]) and batch["image_grid_thw"].tolist() == [[[1, 4, 4]]] * 4


def test_image_key_needs_a_vision_checkpoint_and_an_engine_that_takes_images(task, tmp_path, monkeypatch):
    from transformers import Qwen2Config

    assert make_environment(_config(task, "rollout.engine=vllm")).images is not None  # (an engine of one's own:
    # refused, registry.py: _prompt_images)
    text_model = tmp_path / "text"
    Qwen2Config(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, num_key_value_heads=2).save_pretrained(text_model)
    tiny.save_tokenizer(text_model)
    with pytest.raises(ConfigError, match=r"needs a vision-language checkpoint, but model.hf_path=.* 'qwen2'"):
        make_environment(_config(task, f"model.hf_path={text_model}"))
    with pytest.raises(ConfigError, match=r"data.image_key='images': a step-API class .* takes text prompts only"):
        make_environment(_config(task, "job.environment=my_env.py:MyEnv"))
    import dataclasses

    from megatron_rl.hf import families

    no_images = dataclasses.replace(families.QWEN2_5_VL, support=families.Support())  # a family of one's own
    monkeypatch.setattr(families, "family_of", lambda model_cfg: no_images)
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vLLM with images is not wired for .*Qwen2.5-VL"):
        make_environment(_config(task, "rollout.engine=vllm"))
