"""A Qwen3.5 user job end to end (docs/QWEN35.md): ``bash run_megatron.sh model.hf_path=<tiny Qwen3.5>`` with the
arithmetic prompts of test_generic_job.py and a reward that varies with the sample, 2 gloo ranks (DP2).

- built-in engine: 3 steps with a checkpoint at step 2; the final HF export loads with transformers, trained;
  the step-2 checkpoint, its later state removed (a run killed after step 2), resumes to step 3 with the same
  metrics and a bitwise-equal export;
- vLLM (one engine, CPU): the model with a GDN head dim of 64 trains 2 steps; the job picks bf16 for the engine
  by itself and says so in one line, and the bf16 engine's log-probs agree with the fp32 trainer's within the
  bound it states (``inference/config.py: AGREEMENT_BOUNDS``), after a weight sync too: with ``optimizer.lr=1e-2``
  an engine left on step 1's weights is 0.22 off at step 2 (measured with ``rollout.sync_interval=2``), 7x the
  bound, so step 2's agreement shows that the sync (``hf/qwen35.py: StageStream``) reached every GDN weight.
"""

from __future__ import annotations

import shutil

import pytest
from tests.support.job_run import example_module, metric_rows, run_megatron

from megatron_rl.model import hybrid

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not hybrid.mcore_supports_hybrid(),
                       reason=f"hybrid Gated-DeltaNet models need megatron-core>={hybrid.MIN_MCORE} "
                              "(docs/MEGATRON_CORE.md)"),
]


def _task(tmp_path, **model_overrides):
    """The arithmetic task of test_generic_job.py with a tiny Qwen3.5 of its vocabulary, and a reward that varies
    with the sample (so every GRPO group has a gradient); returns the run's overrides."""
    from tests.support.qwen35_tiny import make_model
    from tests.job.test_generic_job import make_task, overrides

    task = make_task(tmp_path)  # a Qwen3 with the arithmetic tokenizer: replaced by a Qwen3.5
    vocab = example_module("examples/arithmetic/make_model.py").save_tokenizer(task["model"])
    for old in task["model"].glob("*.safetensors"):
        old.unlink()
    make_model(seed=5, vocab_size=vocab, max_position_embeddings=64, **model_overrides).save_pretrained(task["model"])
    reward = tmp_path / "length_reward.py"
    reward.write_text("def match(prompt, response, target):\n    return float(len(response))\n")
    return task, lambda out_dir: [*overrides(task, out_dir, reward), "job.max_new_tokens=4",
                                  "job.n_samples_per_prompt=2", "batch.policy_mini_batch_size=2",
                                  "batch.micro_batch_size=2"]


def _weights(hf_dir):
    from safetensors.torch import load_file

    return {k: v for path in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(path)).items()}


def test_qwen35_trains_exports_and_resumes_exactly(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    task, args = _task(tmp_path)
    straight = tmp_path / "straight"
    run_megatron(*args(straight), "job.num_steps=3", config="")
    full = metric_rows(straight)
    assert [r["step"] for r in full] == [1, 2, 3]
    assert sorted(p.name for p in (straight / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]

    exported = AutoModelForCausalLM.from_pretrained(straight / "hf" / "step_3", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3_5ForCausalLM"
    assert any(not torch.equal(p, original.get_parameter(n)) for n, p in exported.named_parameters())

    killed = tmp_path / "killed"  # the state of a run killed after step 2's checkpoint
    shutil.copytree(straight, killed)
    shutil.rmtree(killed / "checkpoints" / "step_00000003")
    shutil.rmtree(killed / "hf" / "step_3")
    out = run_megatron(*args(killed), "job.num_steps=3", config="").stdout
    assert "resuming after step 2" in out
    assert metric_rows(killed) == full  # same prompts, samples, losses and grad norms, bit for bit
    resumed, reference = _weights(killed / "hf" / "step_3"), _weights(straight / "hf" / "step_3")
    assert resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)


@pytest.mark.engine
def test_qwen35_trains_on_vllm_in_bf16(tmp_path):
    import os

    from tests.support.engine_env import engine_python

    from megatron_rl.inference.config import AGREEMENT_BOUNDS

    os.environ.setdefault("MEGATRON_RL_ENGINE_PYTHON", engine_python())
    _, args = _task(tmp_path, linear_key_head_dim=64, linear_value_head_dim=64)  # vLLM's CPU GDN: 64 or 128
    out_dir = tmp_path / "vllm"
    out = run_megatron(*args(out_dir), "job.num_steps=2", "rollout.engine=vllm", "eval.interval=0",
                       "optimizer.lr=1e-2", config="").stdout
    dtype_lines = [line for line in out.splitlines() if "vLLM engine dtype" in line]
    assert dtype_lines == [f"megatron_rl main job: vLLM engine dtype bfloat16 (vLLM's CPU Gated-DeltaNet kernels "
                           f"run in bf16 only); trainer float32; engine vs trainer log-probs of the sampled tokens "
                           f"within {AGREEMENT_BOUNDS['bfloat16']:.3g} on average (checked every step)"], out[-3000:]
    assert "WARNING" not in out
    rows = metric_rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # step 2 samples from the weights synced after step 1 (measured: 8e-4 mean, 3e-3 max)
        assert r["rollout/engines_alive"] == 1 and r["rollout/failed_samples"] == 0
        assert 0 < r["rollout/logprob_abs_diff_mean"] <= AGREEMENT_BOUNDS["bfloat16"], r
