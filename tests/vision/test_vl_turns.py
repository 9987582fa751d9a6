"""Images in later turns (docs/VISION.md section 14) on the tiny Qwen2.5-VL, fp32 CPU, the built-in engine sampling
from the policy itself (full forwards with the images):

- a step-API class whose first prompt shows the row's picture (``data.image_key``) and whose observation after
  the first reply brings a second one: the engine sees every image of each turn's prompt, each training row
  carries them (turn 2's: turn 1's picture, then the new one), and the policy's log-probs of the rows (step-wise
  and merged into one sequence) equal the engine's sampled ones, and transformers' on the same full sequence;
  planted: turn 2's row without turn 1's picture, or with the pictures in the wrong order: the log-probs move far
  past the bound;
- an OpenAI-client agent whose second call sends a screenshot as an ``image_url`` part of a tool message: its calls
  are sampled with their images (a stand-in for the vLLM fleet that runs the built-in engine on the images it is
  sent, as vLLM does) and its rows score the same under the policy; an unreadable image is a 400 naming it.

Cost: ~16 s CPU (one process; the policy built once). And the main job on such a class (``slow``, ``multirank``: 2
gloo ranks, ~25 s wall): 2 steps, the engine's and the trainer's log-probs within 1e-5, a missing first picture
counted as failed episodes and named."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest
import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.step_api.environment import StepApiEnvironment
from megatron_rl.environments.turn_images import TurnImages
from megatron_rl.inference.builtin_engine import BuiltinEngine
from megatron_rl.inference.engine import SamplingSpec
from tests.support import qwen2_5_vl_tiny as tiny
from tests.vision.vl_task import squares_png

pytestmark = pytest.mark.core  # the policy forward runs megatron-core

IMAGE = tiny.IMAGE
VISION = {tiny.IMAGE_TOKEN, 251, tiny.VISION_START, tiny.VISION_END}
BOUND = 1e-5
SCREENS = f'''
class Screens:
    """Turn 1: the row's picture (data.image_key); the observation after the first reply: a second picture."""

    def __init__(self, images, second):
        self.second, self.turn = second, 0

    def reset(self):
        return "t5 {IMAGE} t6"

    def step(self, response):
        self.turn += 1
        if self.turn == 2:
            return None, float(len(response.split())), True
        return "t7 {IMAGE} t8", 0.0, False, [self.second]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_turns")
    checkpoint = tiny.save_checkpoint(path / "model")
    for count in (1, 2, 3):
        (path / f"squares_{count}.png").write_bytes(squares_png(count))
    url = "data:image/png;base64," + base64.b64encode(squares_png(3)).decode()
    rows = [{"images": ["squares_1.png"], "second": str(path / "squares_2.png")},
            {"images": ["squares_2.png"], "second": url}]
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "screens.py").write_text(SCREENS)
    return {"path": path, "model": checkpoint}


@pytest.fixture(scope="module")
def policy(groups, task):
    return tiny.vl_policy(task["model"], groups)


def turn_images(task) -> TurnImages:
    return TurnImages.from_checkpoint(task["model"], [task["path"]], image_key="images")


def tokenizer(task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(task["model"], local_files_only=True)


def policy_logprobs(policy, out) -> tuple[torch.Tensor, torch.Tensor, TrainingBatch]:
    """The policy's log-probs of the rows' loss tokens and the engine's (``rollout_logprobs``) there."""
    batch = TrainingBatch.from_generator_output(out, pad_token_id=0, step_wise=True)
    got = policy.forward(batch)["logprobs"]
    mask = batch["loss_mask"].bool()
    return got[mask], batch["rollout_logprobs"][mask], batch


def hf_logprobs(task, out) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probs of each row's loss tokens on its whole sequence with its images, and the engine's."""
    hf = tiny.hf_class().from_pretrained(task["model"], dtype=torch.float32).eval()
    got, want = [], []
    for prompt, response, mask, rollout, images in zip(out["prompt_token_ids"], out["response_ids"],
                                                        out["loss_masks"], out["rollout_logprobs"], out["images"]):
        x = torch.tensor(prompt + response)[None]
        pixels = torch.cat([p for p, _ in images])
        with torch.no_grad():
            logits = hf(input_ids=x, mm_token_type_ids=(x == tiny.IMAGE_TOKEN).int(), pixel_values=pixels,
                        image_grid_thw=torch.tensor([g for _, g in images])).logits
        lp = torch.log_softmax(logits[0], -1)[:-1].gather(-1, x[0, 1:, None])[:, 0][-len(response):]
        keep = torch.tensor(mask).bool()
        got.append(lp[keep])
        want.append(torch.tensor(rollout)[keep])
    return torch.cat(got), torch.cat(want)


def test_a_step_api_turn_that_brings_a_new_image_trains_on_every_image_of_its_context(task, policy):
    data = DataConfig(train_files=str(task["path"] / "train.jsonl"), shuffle=False, image_key="images")
    env = StepApiEnvironment(f"{task['path'] / 'screens.py'}:Screens", data, tokenizer(task), seed=3, max_turns=4,
                             max_prompt_tokens=200, images=turn_images(task))
    engine = BuiltinEngine.from_policy(policy, pad_token_id=0)
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=(2,))
    rollouts = env.rollout(engine, spec, num_prompts=2, n_samples_per_prompt=2, seed=1, step_wise=True)
    out = validate_generator_output(rollouts.output, step_wise=True)
    assert rollouts.metrics["rollout/failed_samples"] == 0 and len(out["prompt_token_ids"]) == 8  # 2 x 2 x 2 turns
    assert not any(t in VISION for r in out["response_ids"] for t in r), "a sampled vision token: pick another seed"
    first, second = out["images"][0], out["images"][1]  # row 0, sample 0: turns 1 and 2
    assert len(first) == 1 and len(second) == 2 and torch.equal(second[0][0], first[0][0])
    assert not torch.equal(second[1][0], first[0][0]) and [g for _, g in second] == [(1, 4, 4)] * 2
    image_run = [tiny.VISION_START] + [tiny.IMAGE_TOKEN] * 4 + [tiny.VISION_END]
    assert out["prompt_token_ids"][0] == [5, *image_run, 6]
    assert out["prompt_token_ids"][1][-8:] == [7, *image_run, 8]  # turn 2 = turn 1 + reply + the observation

    got, want, _ = policy_logprobs(policy, out)  # step-wise rows
    assert (got - want).abs().max() < BOUND
    merged, counts = merge_stepwise_output(out)
    assert counts["num_seq_after_merge"] == 4 and [len(i) for i in merged["images"]] == [2] * 4
    got, want, batch = policy_logprobs(policy, merged)  # one sequence per episode, the observation masked
    assert (got - want).abs().max() < BOUND
    hf_got, hf_want = hf_logprobs(task, merged)
    assert (hf_got - hf_want).abs().max() < BOUND

    # planted: turn 2's row without turn 1's picture (its first picture's tokens get the new one, the rest are
    # read as text: docs/VISION.md section 3)
    dropped = dict(out, images=[images[-1:] for images in out["images"]])
    got, want, _ = policy_logprobs(policy, dropped)
    assert (got - want).abs().max() > 100 * BOUND
    # planted: the pictures in the wrong order
    swapped = dict(merged, images=[images[::-1] for images in merged["images"]])
    got, want, _ = policy_logprobs(policy, swapped)
    assert (got - want).abs().max() > 100 * BOUND


AGENT = f'''
import openai

def part(url):
    return {{"type": "image_url", "image_url": {{"url": url}}}}

def agent(base_url, first, screenshot):
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = [{{"role": "user", "content": [{{"type": "text", "text": "t5 "}}, part(first),
                                             {{"type": "text", "text": " t6"}}]}}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3).choices[0].message
    messages += [{{"role": "assistant", "content": reply.content or ""}},
                 {{"role": "user", "content": [{{"type": "text", "text": "t7 "}}, part(screenshot)]}}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3).choices[0].message
    return float(len((reply.content or "").split()))
'''
TEMPLATE = ("{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t3 {% endif %}")


class PolicyCalls:
    """The fleet's ``complete`` (agent calls) through the built-in engine: each call's images are read back from
    the URLs it is sent and encoded by the checkpoint's processor, as vLLM does."""

    def __init__(self, engine: BuiltinEngine, images: TurnImages) -> None:
        self.engine, self.images = engine, images
        self.calls_waiting = threading.Event()
        self.sent: list[int] = []
        self._lock = threading.Lock()

    def complete(self, prompt, spec, *, seed, session, images=None):
        entries = []
        if images is not None:
            pictures = self.images.read(images.urls)
            out = self.images.encoder.image_processor(images=pictures, return_tensors="pt")
            grids = out["image_grid_thw"].tolist()
            entries = list(zip(out["pixel_values"].float().split([t * h * w for t, h, w in grids]), map(tuple, grids)))
        with self._lock:  # the engine's generator is one stream
            self.sent.append(len(entries))
            return self.engine.generate([prompt], spec, seed=seed, images=[entries])[0]

    def end_session(self, session):
        pass

    def serving(self):
        return [0]


def test_an_agents_image_url_parts_are_sampled_and_trained_with_their_images(task, policy):
    pytest.importorskip("openai")
    from megatron_rl.environments.agent.environment import AgentEnvironment

    path = task["path"]
    (path / "agent.py").write_text(AGENT)
    url = lambda count: "data:image/png;base64," + base64.b64encode(squares_png(count)).decode()  # noqa: E731
    (path / "agent_rows.jsonl").write_text("".join(json.dumps({"first": url(a), "screenshot": url(b)}) + "\n"
                                                   for a, b in ((1, 2), (3, 1))))
    tok = tokenizer(task)
    tok.chat_template = TEMPLATE
    images = turn_images(task)
    env = AgentEnvironment(f"{path / 'agent.py'}:agent", DataConfig(train_files=str(path / "agent_rows.jsonl"),
                                                                    shuffle=False),
                           tok, seed=3, max_concurrency=2, max_prompt_tokens=200, tool_call_parser_name="hermes",
                           images=images)
    calls = PolicyCalls(BuiltinEngine.from_policy(policy, pad_token_id=0), images)

    class Engine:
        agent_calls = calls

    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=(2,))
    rollouts = env.rollout(Engine(), spec, num_prompts=2, n_samples_per_prompt=1, seed=7, step_wise=True)
    out = validate_generator_output(rollouts.output, step_wise=True)
    assert rollouts.metrics["rollout/failed_samples"] == 0, rollouts.failures
    assert sorted(calls.sent) == [1, 1, 2, 2] and [len(i) for i in out["images"]] == [1, 2, 1, 2]
    assert not any(t in VISION for r in out["response_ids"] for t in r), "a sampled vision token: pick another seed"
    got, want, _ = policy_logprobs(policy, out)
    assert (got - want).abs().max() < BOUND
    got, want, _ = policy_logprobs(policy, merge_stepwise_output(out)[0])
    assert (got - want).abs().max() < BOUND

    from megatron_rl.environments.agent.endpoint import RequestError, Session

    session = Session("s", tok, calls.complete, spec, seed_of_call=lambda k: k, max_prompt_tokens=200,
                      parse=lambda text: None, tokenizer_lock=threading.Lock(), images=images)
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    with pytest.raises(RequestError, match="an image of these messages cannot be used: image .* cannot be read"):
        session.chat({"messages": [{"role": "user", "content": [broken]}]})


@pytest.mark.slow
@pytest.mark.multirank
def test_the_main_job_trains_a_step_api_class_whose_turns_bring_images(task, tmp_path):
    from tests.support.job_run import metric_rows, run_megatron

    path = task["path"]
    rows = [{"images": [f"squares_{a}.png"], "second": str(path / f"squares_{b}.png")} for a, b in ((1, 2), (2, 3), (3, 1))]
    rows.append({"images": ["gone.png"], "second": str(path / "squares_1.png")})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_dir = tmp_path / "run"
    out = run_megatron(f"model.hf_path={task['model']}", f"data.train_files={tmp_path / 'rows.jsonl'}",
                       "data.image_key=images", f"job.environment={path / 'screens.py'}:Screens",
                       f"logging.output_dir={out_dir}", "logging.progress_bar=false", "job.num_steps=2",
                       "batch.train_batch_size=2", "job.n_samples_per_prompt=2", "batch.policy_mini_batch_size=2",
                       "batch.micro_batch_size=2", "job.max_new_tokens=4", "job.max_turns=3", config="",
                       cwd=path).stdout  # (the pictures' paths relative to the directory the command runs from)
    assert "turns may bring images (the first prompt's: column 'images')" in out and "gone.png" in out, out[-3000:]
    metrics = metric_rows(out_dir)
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:  # every turn's images where the engine had them
        assert r["rollout/logprob_abs_diff_max"] < BOUND and r["episode/turns_mean"] == 2, r
    assert sum(r["rollout/failed_samples"] for r in metrics) == 2  # the row whose first picture is missing
