"""A response that samples the image token (a random or young model does: the image demo's tiny model sampled
``<|image_pad|>`` at its first step) is text, as in generation by transformers and vLLM: its embedding is the
token's own and its 3-D position continues the text (``data/mrope.py: images_tokens``). Before, the trainer's
pack counted it as one more image token and the step raised ``row 3: 17 image tokens, but the images of
image_grid_thw give 32``.

Reference: transformers' generation path, the prompt (with its image) prefilled, then the response fed one token
at a time through the KV cache (no pixel values after the prefill). Planted bug (checked by hand): without
``images_tokens`` (every image token an image's) the policy raises that ValueError. Cost: ~3 s CPU (one process).

The last test: the built-in engine's own KV-cache path with images (``model/kv_cache.py``, docs/VISION.md section
8) against its full-forward path and the trainer's forward (~2 s more).
"""

from pathlib import Path

import pytest
import torch

from tests.support import qwen2_5_vl_tiny as tiny

pytestmark = pytest.mark.core

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny.save_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny")


def generation_logprobs(checkpoint: Path, prompt: list[int], response: list[int], pixels, grid) -> torch.Tensor:
    """transformers' log-probs of ``response`` after ``prompt``, decoded one token at a time from the cache."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    images = dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid])) if grid else {}
    out, lps = hf(input_ids=x, mm_token_type_ids=(x == tiny.IMAGE_TOKEN).int(), use_cache=True, **images), []
    for token in response:
        lps.append(torch.log_softmax(out.logits[0, -1], -1)[token])
        out = hf(input_ids=torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return torch.stack(lps)


def test_an_image_token_in_the_response_is_text(groups, checkpoint):
    from megatron_rl.data.mrope import batch_images
    from tests.support.batches import training_batch

    gen = torch.Generator().manual_seed(0)
    grid = (1, 4, 4)
    pixels = tiny.pixel_values([grid], gen)
    rows = [([5, 6] + tiny.image_tokens(grid) + [7], [tiny.IMAGE_TOKEN, 9, tiny.IMAGE_TOKEN], [(pixels, grid)]),
            ([5, 8, 9], [tiny.IMAGE_TOKEN, 10], [])]  # a text prompt, an image token sampled
    width, resp = max(len(p) + len(r) for p, r, _ in rows), max(len(r) for _, r, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, response_mask = torch.zeros_like(ids), torch.zeros(len(rows), resp, dtype=torch.long)
    for i, (prompt, response, _) in enumerate(rows):
        ids[i, width - len(prompt) - len(response):], mask[i, width - len(prompt) - len(response):] = torch.tensor(
            prompt + response), 1
        response_mask[i, resp - len(response):] = 1
    pixel_values, image_grid_thw = batch_images([images for *_, images in rows])
    tensors = dict(sequences=ids, attention_mask=mask, response_mask=response_mask, loss_mask=response_mask.float(),
                   advantages=torch.zeros(len(rows), resp), pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    got = tiny.vl_policy(checkpoint, groups).forward(training_batch(tensors))["logprobs"]
    for i, (prompt, response, images) in enumerate(rows):
        want = generation_logprobs(checkpoint, prompt, response, pixels if images else None, grid if images else None)
        assert (got[i, resp - len(response):] - want).abs().max() < TOL, (i, got[i], want)


def test_the_builtin_engine_decodes_images_through_the_kv_cache(groups, checkpoint, monkeypatch):
    """The built-in engine's KV-cache path with images (``model/kv_cache.py``: the prompts and their images
    prefilled once, each decoded token at its cached length + the row's rope delta on all three position rows):
    the same tokens as the full-forward path (``from_policy(kv_cache=False)``: the whole context and its images
    every step) for the same seed, and the sampled tokens' log-probs within 1e-5 of the trainer's forward
    (``VisionLanguagePolicy.forward``) on prompt + response. Rows: ``tiny.prompt_rows`` (one image; two images; a
    text row; an image first), each twice (a group). Planted (kept): the rope deltas dropped (decoded tokens at
    their 1-D index, what the text cache does): the log-probs move beyond the bound."""
    from megatron_rl.data.batch import left_pad
    from megatron_rl.data.mrope import batch_images
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.model.kv_cache import KVCache
    from tests.support.batches import training_batch

    gen = torch.Generator().manual_seed(0)
    rows = [r for r in tiny.prompt_rows(gen) for _ in range(2)]
    prompts = [prompt for prompt, _, _ in rows]
    images = []
    for _, grids, _ in rows:
        pixels = torch.split(tiny.pixel_values(grids, gen), [t * h * w for t, h, w in grids]) if grids else []
        images.append(list(zip(pixels, grids)))
    policy = tiny.vl_policy(checkpoint, groups)
    spec = SamplingSpec(max_tokens=6, temperature=1.0)

    def generate(engine):
        return engine.generate(prompts, spec, seed=7, images=images)

    def trainer_diff(completions) -> float:
        seqs = [p + c.token_ids for p, c in zip(prompts, completions)]
        ids, mask = left_pad(seqs, 0)
        width = max(len(c.token_ids) for c in completions)
        response_mask = torch.tensor([[0] * (width - len(c.token_ids)) + [1] * len(c.token_ids) for c in completions])
        pixel_values, image_grid_thw = batch_images(images)
        got = policy.forward(training_batch(dict(
            sequences=ids, attention_mask=mask, response_mask=response_mask, loss_mask=response_mask.float(),
            pixel_values=pixel_values, image_grid_thw=image_grid_thw)))["logprobs"]
        engine = torch.tensor([[0.0] * (width - len(c.logprobs)) + c.logprobs for c in completions])
        return float(((got - engine) * response_mask).abs().max())

    cached_engine = BuiltinEngine.from_policy(policy, 0)
    assert cached_engine.decoder is not None
    cached = generate(cached_engine)
    full = generate(BuiltinEngine.from_policy(policy, 0, kv_cache=False))
    assert [c.token_ids for c in cached] == [c.token_ids for c in full]
    assert trainer_diff(cached) < TOL  # measured 4.8e-7

    commit = KVCache.commit
    monkeypatch.setattr(KVCache, "commit", lambda self: (commit(self), self.rope_deltas.clear()))  # planted
    assert trainer_diff(generate(BuiltinEngine.from_policy(policy, 0))) > TOL  # measured 7.2e-3
