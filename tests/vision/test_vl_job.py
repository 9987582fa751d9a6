"""The main job trains a vision-language checkpoint on image prompts (docs/VISION.md): ``bash run_megatron.sh
model.hf_path=<tiny Qwen2.5-VL or Qwen3.5> data.train_files=<jsonl with images> data.image_key=images
reward.function=...``, 2 gloo ranks (Qwen2.5-VL at DP2, Qwen3.5 at PP2), built-in engine, with a KL loss (its
reference a VisionLanguagePolicy too). The built-in engine samples with the images; the trainer's log-probs of the
sampled tokens (its forward over the packed batch with the images) agree with the engine's within 1e-5; the row
whose image is missing is counted and named, not a crash; the HF export loads in transformers, trained (language
model and vision tower), and gives the trained policy's log-probs (its last distributed checkpoint, loaded here) on
a batch with images (< 1e-5; the source checkpoint, untrained, is farther off: the check sees the training).
"""

from __future__ import annotations

import pytest
from tests.support import qwen2_5_vl_tiny, qwen35_vl_tiny
from tests.support.job_run import metric_rows, run_megatron
from tests.vision.vl_task import make_task, overrides

from megatron_rl.model import hybrid

pytestmark = [pytest.mark.multirank, pytest.mark.core]

FAMILIES = {"qwen2_5_vl": qwen2_5_vl_tiny, "qwen35_vl": qwen35_vl_tiny}


def _export_gives_the_trained_logprobs(groups, source, export, checkpoints, tiny) -> None:
    """The job's last checkpoint in a fresh policy, and its HF export in transformers, give the same response
    log-probs on ``tiny``'s packed batch with images; the untrained source does not."""
    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.data.mrope import mrope_positions, row_images
    from tests.support.batches import training_batch

    policy = tiny.vl_policy(source, groups)
    load_checkpoint(policy, checkpoints, load_optimizer=False)
    tensors, (rows, seqs, pixels) = tiny.batch_tensors()
    got = policy.forward(training_batch(tensors))["logprobs"]
    _, grids = row_images(tensors["pixel_values"], tensors["image_grid_thw"])
    ids, mask = tensors["sequences"], tensors["attention_mask"]
    positions = mrope_positions(ids, mask, grids, image_token_id=tiny.IMAGE_TOKEN, spatial_merge_size=tiny.MERGE)
    response = tensors["response_mask"].bool()
    want = tiny.transformers_logprobs(export, rows, seqs, pixels, ids.shape[1], positions)
    assert (got - want)[response].abs().max() < 1e-5
    untrained = tiny.transformers_logprobs(source, rows, seqs, pixels, ids.shape[1], positions)
    assert (got - untrained)[response].abs().max() > 1e-4


@pytest.mark.parametrize(("family", "layout"), [("qwen2_5_vl", "dp2"), pytest.param("qwen35_vl", "pp2", marks=(
    pytest.mark.skipif(not hybrid.mcore_supports_hybrid(), reason=f"Qwen3.5 needs megatron-core>={hybrid.MIN_MCORE}")
))])
def test_main_job_trains_a_vl_checkpoint_on_image_prompts(tmp_path, groups, family, layout):
    """Qwen3.5 runs at PP2 (its hybrid layers split over the stages, the tower on the first): the engine's
    full forwards, the loss and the export cross the stages; its last checkpoint resumes here in one process."""
    import torch

    tiny = FAMILIES[family]
    task = make_task(tmp_path)
    if family != "qwen2_5_vl":  # the task's prompts and images, this family's tiny model (the same tokenizer)
        task["model"] = tiny.save_checkpoint(tmp_path / family)
    out_dir = tmp_path / "run"
    out = run_megatron(*overrides(task), f"logging.output_dir={out_dir}", "logging.progress_bar=false",
                       "job.num_steps=2", "batch.train_batch_size=4", "job.n_samples_per_prompt=2",
                       "batch.policy_mini_batch_size=2", "batch.micro_batch_size=2", "job.max_new_tokens=4",
                       "algorithm.use_kl_loss=true", "optimizer.lr=1e-2",
                       f"parallel.pipeline_model_parallel_size={2 if layout == 'pp2' else 1}", config="").stdout
    assert "single_turn: train: 5 prompts; 1 train rows left out" in out and "missing.png" in out, out[-3000:]
    assert "WARNING" not in out and ("(TP1 PP2 DP1)" if layout == "pp2" else "(TP1 PP1 DP2)") in out
    rows = metric_rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the engine's and the trainer's forwards see the same images at the same positions
        assert r["rollout/logprob_abs_diff_max"] < 1e-5 and r["data/failed_image_rows"] == 1, r
    exported = tiny.hf_class().from_pretrained(out_dir / "hf" / "step_2", dtype=torch.float32)
    original = tiny.hf_class().from_pretrained(task["model"], dtype=torch.float32)
    changed = {n.split(".")[1] for n, p in exported.named_parameters() if not torch.equal(p, original.get_parameter(n))}
    assert {"language_model", "visual"} <= changed, changed  # the vision tower trains too
    _export_gives_the_trained_logprobs(groups, task["model"], out_dir / "hf" / "step_2", out_dir / "checkpoints", tiny)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen35_vl", marks=pytest.mark.skipif(
    not hybrid.mcore_supports_hybrid(), reason=f"Qwen3.5 needs megatron-core>={hybrid.MIN_MCORE}"))])
def test_main_job_with_the_vllm_fleet_on_image_prompts(tmp_path, family):
    """The same job on ``rollout.engine=vllm`` (Qwen2.5-VL: the tiny model with head size 32, fp32 engine, bound
    1e-4 as tests/job/test_vllm_main_job.py; Qwen3.5: GDN head dims 64, a bf16 engine, ``rollout.dtype=auto``'s
    choice, bound ``AGREEMENT_BOUNDS['bfloat16']`` = 2^-5): the fleet samples with the rows' images
    (``VLLMEngine.generate(images=...)``) and gets the trained weights, vision tower included, after each step."""
    from megatron_rl.inference.config import AGREEMENT_BOUNDS

    task = make_task(tmp_path, head_dim=32)
    bound = AGREEMENT_BOUNDS["float32"]
    if family == "qwen35_vl":
        task["model"] = qwen35_vl_tiny.save_checkpoint(tmp_path / family, linear_key_head_dim=64,
                                                       linear_value_head_dim=64)
        bound = AGREEMENT_BOUNDS["bfloat16"]
    out_dir = tmp_path / "run"
    out = run_megatron(*overrides(task), f"logging.output_dir={out_dir}", "logging.progress_bar=false",
                       "rollout.engine=vllm", "job.num_steps=2", "batch.train_batch_size=4",
                       "job.n_samples_per_prompt=2", "batch.policy_mini_batch_size=2", "batch.micro_batch_size=2",
                       "job.max_new_tokens=4", "optimizer.lr=1e-2", config="").stdout
    assert "1 train rows left out" in out, out[-3000:]
    rows = metric_rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff_max"] < bound and r["data/failed_image_rows"] == 1, r
