"""``data.image_key`` wiring without Megatron (one process, ~3 s CPU): the single_turn environment of a VL job config
encodes the rows' images with the checkpoint's processor and leaves out (counts, names) a row whose image is
missing; its rollouts carry each prompt's images to the engine and in ``GeneratorOutput['images']``, which the
trainer's batch turns into ``pixel_values`` / ``image_grid_thw``; ``data.image_key`` with a text checkpoint, with
an agent is one ConfigError at start-up; the vLLM engine takes them. Images in later turns of a step-API class
(docs/VISION.md section 14): a picture that cannot be read fails its episode (counted, the file named), images
from a class on a text checkpoint stop the start-up, a chat template's turns extend with their images (a changed
earlier picture starts a new step), the rows of a failed episode's group keep the ``images`` field; a reply that
sampled the image token before a later picture fails its episode."""

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
    with pytest.raises(ConfigError, match=r"data.image_key='images' with job.agent=.*sends its images itself"):
        make_environment(_config(task, "job.agent=my_agent.py:agent"))
    import dataclasses

    from megatron_rl.hf import families

    no_images = dataclasses.replace(families.QWEN2_5_VL, support=families.Support())  # a family of one's own
    monkeypatch.setattr(families, "family_of", lambda model_cfg: no_images)
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vLLM with images is not wired for .*Qwen2.5-VL"):
        make_environment(_config(task, "rollout.engine=vllm"))


TURNS = f"""
class Screens:
    def __init__(self, images, second):
        self.second = second

    def reset(self):
        return "t5 {tiny.IMAGE} t6"  # a user message under a chat template (set below), raw text without

    def step(self, response):
        return {{"observation": "t7 {tiny.IMAGE}", "reward": 1.0, "done": False, "images": [self.second]}}
"""
TEMPLATE = "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t3 {% endif %}"


def test_step_api_turns_bring_images_and_a_picture_that_cannot_be_read_fails_its_episode(task, tmp_path):
    import json

    from megatron_rl.environments.conversation import Conversation

    (tmp_path / "screens.py").write_text(TURNS)
    good = str(task["data"].parent / "squares_0.png")
    rows = [{"images": [good], "second": good}, {"images": [str(tmp_path / "gone.png")], "second": good},
            {"images": [good], "second": str(tmp_path / "also_gone.png")}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step_api = [f"job.environment={tmp_path / 'screens.py'}:Screens", f"data.train_files={tmp_path / 'rows.jsonl'}",
                "job.max_turns=2", "job.max_new_tokens=8", "data.shuffle=false"]
    env = make_environment(_config(task, *step_api))
    assert env.images is not None and "turns may bring images (the first prompt's: column 'images')" in env.describe()
    env.tokenizer.chat_template = TEMPLATE
    seen = []

    def image_logprobs(contexts, images):
        seen.append([len(i) for i in images])
        return uniform_next_token_logprobs(tiny.VOCAB)(contexts)

    engine = BuiltinEngine(uniform_next_token_logprobs(tiny.VOCAB), image_logprobs=image_logprobs)
    spec = SamplingSpec(max_tokens=2, temperature=1.0, stop_token_ids=(2,))
    out = env.rollout(engine, spec, num_prompts=3, n_samples_per_prompt=1, seed=0, step_wise=True)
    assert seen[0] == [1, 1] and seen[-1] == [2]  # row 1 failed at reset, row 2 at its step; row 0's turn 2: both
    assert out.metrics["rollout/failed_samples"] == 2 and [f.row for f in out.failures] == [1, 2]
    assert "gone.png" in out.failures[0].error and "column 'images'" in out.failures[0].error
    assert "also_gone.png" in out.failures[1].error and "step(response): the next prompt's images" in out.failures[1].error
    kept = out.output  # the failed groups keep one masked placeholder each, with no images
    assert [len(i) for i in kept["images"]] == [1, 2, 0, 1] and kept["loss_masks"][2] == [0]

    # a chat template's turn extends with its images; a conversation that swaps an earlier picture starts anew
    conversation = Conversation(env.tokenizer, [{"role": "user", "content": f"t5 {tiny.IMAGE}"}], images=env.images,
                                first_images=[good])
    conversation.add_response([9], [-1.0], "length")
    seen = conversation.prompt_ids + [9]
    conversation.add_observation([{"role": "user", "content": f"t7 {tiny.IMAGE}"}], [good])
    assert conversation.prompt_ids[:len(seen)] == seen and len(conversation.images) == 2
    history = conversation.messages
    conversation.add_response([9], [-1.0], "length")
    conversation.continue_with(history + [{"role": "user", "content": "t8"}], None,
                               [str(task["data"].parent / "squares_1.png"), good])  # another first picture
    assert [t.extends for t in conversation.turns] == [False, True] and conversation.new_steps == 0
    conversation.add_response([9], [-1.0], "length")
    assert conversation.new_steps == 1 and conversation.prompt_ids.count(tiny.IMAGE_TOKEN) == 8
    assert not torch.equal(conversation.images[0][0], conversation.turns[0].images[0][0])

    # a reply that sampled the image token: the next prompt with images cannot be read alike by the engines
    from megatron_rl.data.images import ImageError

    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(task["model"], local_files_only=True)  # no template: the reply is kept
    conversation = Conversation(raw, f"t5 {tiny.IMAGE}", images=env.images, first_images=[good])
    conversation.add_response([tiny.IMAGE_TOKEN, 9], [-1.0, -1.0], "length")
    with pytest.raises(ImageError, match="holds 9 image tokens, its 2 image.s. take 8: a reply sampled the image"):
        conversation.add_observation(f"t7 {tiny.IMAGE}", [good])

    # images from a class on a text checkpoint: one line at start-up
    from transformers import Qwen2Config

    text_model = tmp_path / "text"
    Qwen2Config(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, num_key_value_heads=2).save_pretrained(text_model)
    tiny.save_tokenizer(text_model)
    with pytest.raises(ConfigError, match=r"Screens.step\(response\) returned an observation .* images need a "
                                          r"vision-language model.hf_path"):
        make_environment(load_job_config(BASE, [f"model.hf_path={text_model}", *step_api]))
