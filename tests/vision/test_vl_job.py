"""The main job trains a vision-language checkpoint on image prompts (docs/VISION.md): ``bash run_megatron.sh
model.hf_path=<tiny Qwen2.5-VL> data.train_files=<jsonl with images> data.image_key=images reward.function=...``,
2 gloo ranks (DP2), built-in engine, with a KL loss (its reference a VisionLanguagePolicy too). The built-in engine
samples with the images; the trainer's log-probs of the sampled tokens (its forward over the packed batch with
the images) agree with the engine's within 1e-5; the row whose image is missing is counted and named, not a crash;
the HF export loads in transformers, trained.
"""

from __future__ import annotations

import pytest
from tests.support.job_run import metric_rows, run_megatron
from tests.vision.vl_task import make_task, overrides

pytestmark = [pytest.mark.multirank, pytest.mark.core]


def test_main_job_trains_a_vl_checkpoint_on_image_prompts(tmp_path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    task = make_task(tmp_path)
    out_dir = tmp_path / "run"
    out = run_megatron(*overrides(task), f"logging.output_dir={out_dir}", "logging.progress_bar=false",
                       "job.num_steps=2", "batch.train_batch_size=4", "job.n_samples_per_prompt=2",
                       "batch.policy_mini_batch_size=2", "batch.micro_batch_size=2", "job.max_new_tokens=4",
                       "algorithm.use_kl_loss=true", "optimizer.lr=1e-2", config="").stdout
    assert "single_turn: train: 5 prompts; 1 train rows left out" in out and "missing.png" in out, out[-3000:]
    assert "WARNING" not in out
    rows = metric_rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the engine's and the trainer's forwards see the same images at the same positions
        assert r["rollout/logprob_abs_diff_max"] < 1e-5 and r["data/failed_image_rows"] == 1, r
    exported = Qwen2_5_VLForConditionalGeneration.from_pretrained(out_dir / "hf" / "step_2", dtype=torch.float32)
    original = Qwen2_5_VLForConditionalGeneration.from_pretrained(task["model"], dtype=torch.float32)
    changed = {n.split(".")[1] for n, p in exported.named_parameters() if not torch.equal(p, original.get_parameter(n))}
    assert {"language_model", "visual"} <= changed, changed  # the vision tower trains too


@pytest.mark.engine
@pytest.mark.slow
def test_main_job_with_the_vllm_fleet_on_image_prompts(tmp_path):
    """The same job on ``rollout.engine=vllm`` (the tiny model with head size 32; fp32 engine, bound 1e-4 as
    tests/job/test_vllm_main_job.py): the fleet samples with the rows' images (``VLLMEngine.generate(images=...)``)
    and gets the trained weights, vision tower included, after each step."""
    task = make_task(tmp_path, head_dim=32)
    out_dir = tmp_path / "run"
    out = run_megatron(*overrides(task), f"logging.output_dir={out_dir}", "logging.progress_bar=false",
                       "rollout.engine=vllm", "job.num_steps=2", "batch.train_batch_size=4",
                       "job.n_samples_per_prompt=2", "batch.policy_mini_batch_size=2", "batch.micro_batch_size=2",
                       "job.max_new_tokens=4", "optimizer.lr=1e-2", config="").stdout
    assert "1 train rows left out" in out, out[-3000:]
    rows = metric_rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff_max"] < 1e-4 and r["data/failed_image_rows"] == 1, r
