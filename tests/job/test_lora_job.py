"""A user's HF model trains a LoRA adapter (``model.lora.rank=16``) through ``bash run_megatron.sh`` on vLLM
(docs/LORA.md): the task of test_generic_job.py (a model, prompts and a reward the repository does not ship), one
engine, 3 steps synchronous and 3 steps one-step-off (``rollout.max_staleness=1``), one launch each; then 2 steps
on the built-in engine (which samples with the live adapters: nothing to sync).

Every synchronous step samples with the trainer's adapter (``rollout/logprob_abs_diff_max`` <= 1e-4; one-step-off:
step 1, whose weights the engine has), and each sync sent the adapter only: ``rollout/weight_sync_bytes`` equals
the bytes of the peft adapter the job exports (``hf/step_3/adapter``), a fraction of the merged model beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.job_run import metric_rows, run_megatron

pytestmark = [pytest.mark.engine, pytest.mark.multirank, pytest.mark.slow]

TOLERANCE = 1e-4  # as in tests/inference/test_vllm_sync.py


def tensor_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    return total


def test_lora_trains_on_vllm_sync_and_one_step_off(tmp_path, monkeypatch):
    from tests.support.engine_env import engine_python
    from tests.job.test_generic_job import make_task, overrides

    monkeypatch.setenv("MEGATRON_RL_ENGINE_PYTHON", engine_python())
    task = make_task(tmp_path)
    reward = tmp_path / "length_reward.py"  # varies with the sample: every GRPO group has a gradient, B moves
    reward.write_text("def match(prompt, response, target):\n    return float(len(response))\n")
    rows = {}
    for mode, extra in (("sync", ()), ("async", ("rollout.max_staleness=1",))):
        out = tmp_path / mode
        run_megatron(*overrides(task, out, reward), "model.lora.rank=16", "rollout.engine=vllm",
                     "rollout.num_engines=1", "job.num_steps=3", "checkpoint.save_interval=0", "job.max_new_tokens=6",
                     *extra)
        rows[mode] = metric_rows(out)
        adapter = tensor_bytes(out / "hf" / "step_3" / "adapter")
        assert [r["step"] for r in rows[mode]] == [1, 2, 3]
        assert [r["rollout/weight_sync_bytes"] for r in rows[mode]] == [adapter] * 3  # the adapter, nothing else
        assert adapter < tensor_bytes(out / "hf" / "step_3")  # the merged model (r=16 on hidden 64: 42% of it)
        assert all(r["rollout/zero_advantage_groups"] < 1 for r in rows[mode])  # the adapter trains
    assert all(0 < r["rollout/logprob_abs_diff_max"] <= TOLERANCE for r in rows["sync"]), rows["sync"]
    assert [r["rollout/staleness_max"] for r in rows["async"]] == [0, 1, 1]
    assert rows["async"][0]["rollout/logprob_abs_diff_max"] <= TOLERANCE

    out = tmp_path / "builtin"
    run_megatron(*overrides(task, out, reward), "model.lora.rank=16", "job.num_steps=2", "checkpoint.save_interval=0",
                 "job.max_new_tokens=6")
    builtin = metric_rows(out)
    assert all(0 < r["rollout/logprob_abs_diff_max"] <= TOLERANCE and "rollout/weight_sync_bytes" not in r
               for r in builtin), builtin
    assert (out / "hf" / "step_2" / "adapter" / "adapter_model.safetensors").is_file()
