"""vLLM serves the tiny Qwen2.5-VL with images in the prompt, token in / token out, and the weight sync feeds it the
trainer's vision tower with its language model. The tiny Qwen3.5 multimodal model too (the last test: a bf16
engine, its own bound and planted bug, in its docstring).

One engine (fp32, CPU; the tiny model with head size 32, which vLLM's CPU attention needs) started by
``VLLMEngine.start`` on the trainer's export; prompts of 3 rows with PNG images of two sizes, encoded by the
trainer (``data/images.py``); each sampled through ``EngineServer.sample(images=...)``: the image-token runs go as
one token each with the images as ``data:`` URLs, vLLM expands them with its own image processor and its expanded
prompt must equal the trainer's (``inference/vllm/images.py``). Checks, against the trainer's
``VisionLanguagePolicy`` log-probs of the engine's samples (bound 1e-4, tests/job/test_vllm_main_job.py's
TOLERANCE: both fp32, other kernels):

- before any training: within the bound; planted bug: the trainer scores each sample with the images of the
  other 16 x 16 row (same token layout, other pixels): beyond the bound; the same through
  ``VLLMEngine.generate(images=...)`` (the fleet's routing and grouping: a group is a prompt with its images);
  and an agent's second call whose observation brought a new picture (``Fleet.complete(images=...)``, the
  multi-turn path of docs/VISION.md section 14: the reply between the two pictures' runs);
- ``model.freeze_vision`` (docs/VISION.md section 13): a frozen-tower policy's Adam step synced (its stream has no
  tower: the engine keeps the one it started on, which the frozen tower still equals): within the bound; the sync
  is the tower's bytes (196,224: 49,056 fp32 parameters) lighter than the next full sync's (a sync that still sent
  the tower would be as heavy: the test fails);
- after one SGD step (lr 0.05: the tower moves) and ``update_weights``: within the bound again; planted bug: one
  more step synced without the vision tensors (the language model only, as before this slice): beyond the bound.

Measured: 4.8e-7 before and after the sync and through ``generate``; the swapped images 6.6e-3, the language-only
sync 5.0e-3, ``generate`` with the fleet grouping samples by tokens alone (planted in ``calls.py``, checked) 4.3e-3.
Cost: ~17 s wall on the 2-core machine (one engine start, four syncs; the freeze case ~1.4 s of it). Markers: ``engine``, ``core``.
"""

from __future__ import annotations

import base64

import pytest
import torch

from megatron_rl.model import hybrid
from tests.support import qwen2_5_vl_tiny as tiny
from tests.vision.test_freeze_vision import adam_policy

pytestmark = [pytest.mark.engine, pytest.mark.core]

TOLERANCE = 1e-4
IMAGE = tiny.IMAGE



def _prompts(checkpoint):
    """(token ids, [(pixel_values, grid)], [data URL]) per row: two 16 x 16 images (4 tokens each), one 16 x 24
    image after text, and a row with two images (24 x 16 and 16 x 16)."""
    from megatron_rl.data.images import ImageEncoder, read_image

    encoder = ImageEncoder.from_checkpoint(checkpoint)
    rows = [(f"t5 {IMAGE} t6 t7", [tiny.random_png(16, 16, 0)]), (f"t5 {IMAGE} t6 t7", [tiny.random_png(16, 16, 1)]),
            (f"t8 t9 {IMAGE} t3", [tiny.random_png(16, 24, 2)]), (f"{IMAGE} t4 {IMAGE} t8", [tiny.random_png(24, 16, 3), tiny.random_png(16, 16, 4)])]
    out = []
    for text, pngs in rows:
        urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pngs]
        ids, pixels, grids = encoder.encode(text, [read_image(u) for u in urls])
        chunks = torch.split(pixels, grids.prod(-1).tolist())
        out.append((ids, list(zip(chunks, [tuple(g) for g in grids.tolist()])), urls))
    return out


def _sample(engine, prompts, seed: int):
    """Two samples of 5 tokens per prompt from engine 0: [(prompt row, response ids, engine log-probs)]."""
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.images import EngineImages

    spec = SamplingSpec(max_tokens=5, temperature=1.0)
    server = engine.fleet.slots[0].server
    out = []
    for i, (ids, _, urls) in enumerate(prompts):
        for c in server.sample(ids, spec, seed=seed + 10 * i, n=2, timeout_s=300,
                               images=EngineImages(tuple(urls), tiny.IMAGE_TOKEN)):
            out.append((i, c.token_ids, c.logprobs))
    return out


def _trainer_logprobs(policy, prompts, samples, images=None):
    """[n, 5] the policy's log-probs of the samples (each row with ``images[row]``, default its own)."""
    from megatron_rl.data.batch import left_pad
    from megatron_rl.data.mrope import batch_images
    from tests.support.batches import training_batch

    seqs = [prompts[i][0] + list(r) for i, r, _ in samples]
    ids, mask = left_pad(seqs, 0)
    width = max(len(r) for _, r, _ in samples)
    response_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for _, r, _ in samples])
    images = images or [p[1] for p in prompts]
    pixel_values, image_grid_thw = batch_images([images[i] for i, _, _ in samples])
    tensors = dict(sequences=ids, attention_mask=mask, response_mask=response_mask,
                   loss_mask=response_mask.float(), pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    with torch.no_grad():
        return policy.forward(training_batch(tensors))["logprobs"], tensors


def _diff(policy, prompts, samples, images=None) -> float:
    got, _ = _trainer_logprobs(policy, prompts, samples, images)
    engine = torch.tensor([lp for _, _, lp in samples])
    return (got - engine).abs().max().item()


def _train_and_sync(policy, engine, prompts, samples) -> None:
    """One SGD step on the samples (random advantages), then the weight sync."""
    from tests.model.test_policy_multirank import summed_pg_loss
    from tests.support.batches import training_batch

    _, tensors = _trainer_logprobs(policy, prompts, samples)
    gen = torch.Generator().manual_seed(len(samples))
    tensors["advantages"] = torch.randn(tensors["response_mask"].shape, generator=gen) * tensors["response_mask"]
    policy.forward_backward(training_batch(tensors), summed_pg_loss, None)
    policy.optim_step()
    engine.update_weights(policy)


def _generate(engine, prompts):
    """``VLLMEngine.generate(images=...)``, groups of 2 samples, the images as the environment gives them
    (``RowImages``: patches and URLs, one object per group). Rows 0 and 1 have equal tokens and other images: a
    fleet that grouped samples by tokens alone would sample row 1 with row 0's image."""
    from megatron_rl.environments.single_turn.images import RowImages
    from megatron_rl.inference.engine import SamplingSpec

    rows = []
    for _, images, urls in prompts:
        rows.append(RowImages(images))
        rows[-1].urls = tuple(urls)
    order = [0, 0, 1, 1, 2, 2, 3, 3]
    completions = engine.generate([prompts[i][0] for i in order], SamplingSpec(max_tokens=5, temperature=1.0),
                                  seed=5, images=[rows[i] for i in order])
    return [(i, c.token_ids, c.logprobs) for i, c in zip(order, completions)]


def _agent_turn(engine, prompts, reply, checkpoint):
    """A second turn of a multi-turn conversation (docs/VISION.md section 14) through an agent's call
    (``Fleet.complete(images=...)``): row 0's prompt, a reply, and an observation bringing a new picture (row 2's
    16 x 24); its prompt holds both pictures. ``(prompts, samples)`` of it for ``_diff``."""
    from megatron_rl.data.images import ImageEncoder, read_image
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.images import EngineImages

    ids, images, urls = prompts[0]
    picture = read_image(prompts[2][2][0])
    new, pixels, grids = ImageEncoder.from_checkpoint(checkpoint).encode(f"t7 {IMAGE} t8", [picture])
    turn = [(ids + list(reply) + new, images + [(pixels, tuple(grids[0].tolist()))], urls + prompts[2][2])]
    completion = engine.fleet.complete(turn[0][0], SamplingSpec(max_tokens=5, temperature=1.0), seed=7,
                                       session="agent", images=EngineImages(tuple(turn[0][2]), tiny.IMAGE_TOKEN))
    return turn, [(0, completion.token_ids, completion.logprobs)]


def _no_vision(self, model_chunks, groups):
    """Planted bug: the weight sync's stream without the vision tower (what it sent before this slice)."""
    return iter(())


def test_vllm_samples_with_images_match_the_trainer_before_and_after_a_sync(groups, engine_py, tmp_path, monkeypatch):
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.vllm.engine import VLLMEngine
    from megatron_rl.model.weights import unwrap

    checkpoint = tiny.save_checkpoint(tmp_path / "model", head_dim=32)
    policy = tiny.vl_policy(checkpoint, groups)
    prompts = _prompts(checkpoint)
    engine = VLLMEngine.start(policy, RolloutConfig(engine="vllm"), hf_dir=checkpoint, work_dir=tmp_path / "engine")
    try:
        samples = _sample(engine, prompts, seed=0)
        assert _diff(policy, prompts, samples) < TOLERANCE
        swapped = [p[1] for p in prompts]
        swapped[0], swapped[1] = swapped[1], swapped[0]  # planted: the other 16 x 16 row's image
        assert _diff(policy, prompts, samples, swapped) > TOLERANCE

        assert _diff(policy, prompts, _generate(engine, prompts)) < TOLERANCE
        assert _diff(policy, *_agent_turn(engine, prompts, samples[0][1], checkpoint)) < TOLERANCE

        frozen = adam_policy(checkpoint, groups, freeze_vision=True)  # the sync leaves the engine's tower alone
        _train_and_sync(frozen, engine, prompts, samples)
        frozen_bytes = engine.last_sync_bytes
        assert _diff(frozen, prompts, _sample(engine, prompts, seed=50)) < TOLERANCE

        _train_and_sync(policy, engine, prompts, samples)  # the whole model again: the policy's
        tower = unwrap(policy.module).visual.parameters()
        assert engine.last_sync_bytes - frozen_bytes == sum(p.numel() * p.element_size() for p in tower)
        samples = _sample(engine, prompts, seed=100)
        assert _diff(policy, prompts, samples) < TOLERANCE  # the tower moved (lr 0.05) and the engine's with it

        from megatron_rl.hf.families.qwen2_5_vl import VisionStageStream

        monkeypatch.setattr(VisionStageStream, "extra_stage_weights", _no_vision)
        _train_and_sync(policy, engine, prompts, samples)
        samples = _sample(engine, prompts, seed=200)
        assert _diff(policy, prompts, samples) > TOLERANCE
    finally:
        engine.close()


def test_image_token_runs_go_to_the_engine_as_one_token_and_its_expansion_is_checked():
    from megatron_rl.inference.engine import EngineError
    from megatron_rl.inference.vllm.images import EngineImages

    images = EngineImages(("data:a", "data:b"), image_token=9)
    prompt = [1, 8, 9, 9, 9, 9, 7, 5, 8, 9, 7]
    request = images.request(prompt)
    assert request["token_ids"] == [1, 8, 9, 7, 5, 8, 9, 7]
    assert [p["url"] for p in request["content_parts"]] == ["data:a", "data:b"]
    images.check(prompt, prompt, "url")
    with pytest.raises(EngineError, match="expanded the prompt's 2 image"):
        images.check(prompt, [1, 8, 9, 9, 7, 5, 8, 9, 7], "url")
    with pytest.raises(ValueError, match="1 image-token runs"):
        EngineImages(("data:a", "data:b"), image_token=9).request([1, 9, 9, 2])


@pytest.mark.skipif(not hybrid.mcore_supports_hybrid(), reason=f"Qwen3.5 needs megatron-core>={hybrid.MIN_MCORE}")
def test_vllm_serves_qwen35_with_images_and_syncs_its_vision_tower(groups, engine_py, tmp_path, monkeypatch):
    """The tiny Qwen3.5 multimodal model (``qwen35_vl_tiny``, GDN head dims 64 as vLLM's CPU kernels need) on a bf16
    engine (``rollout.dtype=auto``: vLLM's CPU GDN kernels run bf16 only) against the fp32 trainer: vLLM's expanded
    prompts equal the trainer's (``EngineImages.check``, inside ``sample``), its log-probs agree within the bf16
    bound (``AGREEMENT_BOUNDS``, 2^-5; measured max 3.3e-3), directly and through ``generate``. The weight sync
    reaches the tower (``model.visual.*``): with the tower's merger output re-drawn (another direction: a rescale
    alone is undone by the language model's norms) and synced, the engine agrees again (3.3e-3); planted, the same
    sync without the vision tensors: 0.23, far beyond the bound. Cost: ~25 s wall (one bf16 engine, two syncs)."""
    from megatron_rl.inference.config import AGREEMENT_BOUNDS, RolloutConfig
    from megatron_rl.inference.vllm.engine import VLLMEngine
    from megatron_rl.hf.families.qwen2_5_vl import VisionStageStream
    from megatron_rl.model.weights import unwrap
    from tests.support import qwen35_vl_tiny

    bound = AGREEMENT_BOUNDS["bfloat16"]
    checkpoint = qwen35_vl_tiny.save_checkpoint(tmp_path / "model", linear_key_head_dim=64, linear_value_head_dim=64)
    policy = qwen35_vl_tiny.vl_policy(checkpoint, groups)
    prompts = _prompts(checkpoint)  # the same tokenizer, image token and processor as the Qwen2.5-VL tiny model
    engine = VLLMEngine.start(policy, RolloutConfig(engine="vllm"), hf_dir=checkpoint, work_dir=tmp_path / "engine")
    try:
        assert _diff(policy, prompts, _sample(engine, prompts, seed=0)) < bound
        assert _diff(policy, prompts, _generate(engine, prompts)) < bound
        weight = unwrap(policy.module).visual.merger.linear_fc2.weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 20 * weight.std())
        with monkeypatch.context() as planted:
            planted.setattr(VisionStageStream, "extra_stage_weights", _no_vision)
            engine.update_weights(policy)
            assert _diff(policy, prompts, _sample(engine, prompts, seed=50)) > bound
        engine.update_weights(policy)
        assert _diff(policy, prompts, _sample(engine, prompts, seed=100)) < bound
    finally:
        engine.close()
