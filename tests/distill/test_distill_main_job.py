"""Pure distillation from two routed teachers through the main job (``bash run_megatron.sh``, two ranks, CPU):
no ``reward.function``, prompts with a ``domain`` column, one teacher for 'math' rows and one for 'code' rows
('art' rows have none); the 'math' teacher in the trainer's ranks, the 'code' teacher served by a vLLM server of its
own (``engine: vllm``: rank 0 scores, both ranks get its log-probs); the student's rollouts on the vLLM rollout
engine (``rollout.engine=vllm``: both engines of the done-when, the builtin one being the bench's and the other
distill tests'). Checked: the run finishes, the student sampled on its vLLM engine (weights synced, engine and
trainer log-probs agree), every reward is 0, each teacher scores tokens of its rows only (the step's tokens split
between them and the unscored rows), summary.txt says pure distillation, and both servers' logs are in
``<output_dir>/engine``.
Cost: ~60-90 s (the main job's start-up on 2 cores, the policy engine's and the teacher server's starts; one
step; the vLLM rollout engine added ~20-40 s to the builtin-engine run this test was before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.job_run import example_module, run_megatron

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.engine]

DOMAINS = ["math", "code", "art"]


def test_pure_distillation_from_two_routed_teachers_runs_without_a_reward_function(tmp_path, engine_py):
    make_model = example_module("examples/arithmetic/make_model.py").make_model
    for name, seed in (("student", 5), ("math", 6), ("code", 7)):  # one tokenizer, three random models
        make_model(tmp_path / name, seed=seed)
    rows = [{"prompt": f"{a} plus one equals", "domain": DOMAINS[a % 3]} for a in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    teachers = ", ".join(f"{{name: {d}, hf_path: {tmp_path / d}, when: {{domain: {d}}}, engine: {engine}}}"
                         for d, engine in (("math", "megatron"), ("code", "vllm")))
    out = tmp_path / "out"
    run_megatron(f"model.hf_path={tmp_path / 'student'}", f"data.train_files={tmp_path / 'prompts.jsonl'}",
                 f"distillation.teachers=[{teachers}]", f"logging.output_dir={out}", "logging.progress_bar=false",
                 "batch.train_batch_size=8", "data.shuffle=false", "job.num_steps=1", "checkpoint.save_interval=0",
                 "rollout.engine=vllm", f"rollout.engine_python={engine_py}")
    (step,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step["reward/mean"] == 0.0 and step["distill/unscored_rows"] > 0  # every prompt once: 2 'art' prompts
    assert step["distill/math/tokens"] > 0 and step["distill/code/tokens"] > 0
    assert step["distill/math/tokens"] + step["distill/code/tokens"] < step["batch/loss_tokens"]  # 'art': none
    assert "pure distillation (every reward 0)" in Path(out / "summary.txt").read_text()
    assert (out / "engine" / "teacher_code.log").is_file()
    # the student's samples came from its vLLM engine, fed the policy's weights, not from the trainer's forward
    assert step["rollout/engines_alive"] == 1.0 and step["rollout/weight_sync_bytes"] > 0
    assert step["rollout/logprob_abs_diff_mean"] < 1e-4 and (out / "engine" / "engine0.log").is_file()
