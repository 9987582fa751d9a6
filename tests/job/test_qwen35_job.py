"""A Qwen3.5 user job end to end (docs/QWEN35.md): ``bash run_megatron.sh model.hf_path=<tiny Qwen3.5>`` with the
arithmetic prompts of test_generic_job.py and a reward that varies with the sample, on the built-in engine
(2 gloo ranks: DP2) for 2 steps with a checkpoint; the final HF export loads with transformers, trained.
"""

from __future__ import annotations

import pytest
from job_run import example_module, metric_rows, run_megatron

from megatron_rl.model import hybrid

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not hybrid.mcore_supports_hybrid(),
                       reason=f"hybrid Gated-DeltaNet models need megatron-core>={hybrid.MIN_MCORE} "
                              "(docs/MEGATRON_CORE.md)"),
]


def test_qwen35_trains_through_the_main_job_and_exports(tmp_path):
    import torch
    from qwen35_tiny import make_model
    from test_generic_job import make_task, overrides
    from transformers import AutoModelForCausalLM

    task = make_task(tmp_path)  # a Qwen3 with the arithmetic tokenizer: replaced by a Qwen3.5 of that vocabulary
    vocab = example_module("examples/arithmetic/make_model.py").save_tokenizer(task["model"])
    for old in task["model"].glob("*.safetensors"):
        old.unlink()
    make_model(seed=5, vocab_size=vocab, max_position_embeddings=64).save_pretrained(task["model"])
    reward = tmp_path / "length_reward.py"  # varies with the sample, so every GRPO group has a gradient
    reward.write_text("def match(prompt, response, target):\n    return float(len(response))\n")
    out_dir = tmp_path / "out"
    run_megatron(*overrides(task, out_dir, reward), "job.num_steps=2", "job.max_new_tokens=4",
                 "job.n_samples_per_prompt=2", "batch.policy_mini_batch_size=2", "batch.micro_batch_size=2",
                 config="")
    assert [r["step"] for r in metric_rows(out_dir)] == [1, 2]
    assert [p.name for p in (out_dir / "checkpoints").glob("step_*")] == ["step_00000002"]

    exported = AutoModelForCausalLM.from_pretrained(out_dir / "hf" / "step_2", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3_5ForCausalLM"
    assert any(not torch.equal(p, original.get_parameter(n)) for n, p in exported.named_parameters())
