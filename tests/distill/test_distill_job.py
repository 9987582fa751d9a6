"""The main job's side of distillation (fast, one process; ~3 s): ``reward.function`` may be omitted under
``distillation.teachers`` (pure distillation), ``when`` needs an environment with data columns, the pre-flight
checks the teachers (vocabulary, routing columns) in seconds, and the summary of a pure-distillation run claims
nothing of its constant reward but reports the reverse KL's trend."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.job.config import load_job_config
from megatron_rl.job.preflight import load_job_rl_config
from megatron_rl.job.reporting import WallTimes, summary_paragraph
from tests.distill.conftest import make_teacher
from tests.support.job_run import ROOT, example_module

CPU = ROOT / "configs" / "demo_cpu.yaml"
ARITH = ROOT / "configs" / "arithmetic_cpu.yaml"
PROMPTS = ["model.hf_path=some/model", "data.train_files=examples/arithmetic/train.jsonl",
           "job.environment=single_turn"]
ONE = "distillation.teachers=[{name: big, hf_path: /ckpt/teacher}]"


def test_reward_function_may_be_omitted_only_when_distilling():
    config = load_job_config(CPU, [*PROMPTS, ONE])
    assert config.environment == "single_turn" and config.reward.function is None
    with pytest.raises(ConfigError, match=r"single_turn needs reward\.function; .* or distil from a teacher"):
        load_job_config(CPU, [*PROMPTS, ONE, "distillation.coef=0"])
    with pytest.raises(ConfigError, match=r"single_turn needs reward\.function"):
        load_job_config(CPU, PROMPTS)


def test_when_needs_an_environment_whose_rows_have_data_columns():
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\]\.when=\{'d': 1\}: job\.environment="
                                          r"'next_digit' gives its rows no data columns"):
        load_job_config(CPU, ["distillation.teachers=[{name: a, hf_path: /x, when: {d: 1}}]"])


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    path = tmp_path_factory.mktemp("student") / "model"
    example_module("examples/arithmetic/make_model.py").make_model(path, seed=5)  # vocabulary 17, a tokenizer
    return path


def test_the_preflight_checks_the_teachers(student, teacher_dir, tmp_path):
    base = [f"model.hf_path={student}", "reward.function=", f"logging.output_dir={tmp_path}"]
    rl = load_job_rl_config(str(ARITH), [*base, f"distillation.teachers=[{{name: t, hf_path: {teacher_dir}}}]"])
    assert rl.distillation.teachers[0].hf_path == str(teacher_dir)  # vocabulary 129 >= 17, no tokenizer files
    small = make_teacher(tmp_path / "small", vocab=10)
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\]\.hf_path=.*vocab_size 10 is smaller than "
                                          r"the student's 17"):
        load_job_rl_config(str(ARITH), [*base, f"distillation.teachers=[{{name: t, hf_path: {small}}}]"])
    routed = f"distillation.teachers=[{{name: t, hf_path: {teacher_dir}, when: {{domain: math}}}}]"
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\]\.when: no row of data\.train_files has a "
                                          r"column 'domain' \(columns: \['answer'\]\)"):
        load_job_rl_config(str(ARITH), [*base, routed])


def test_the_summary_of_pure_distillation_reports_the_reverse_kl_not_the_reward():
    rows = [{"step": s, "reward/mean": 0.0, "reward/min": 0.0, "reward/max": 0.0,
             "rollout/zero_advantage_groups": 1.0, "distill/big/reverse_kl": 6.0 - 0.2 * s} for s in range(1, 21)]
    text = summary_paragraph(rows, baseline=0.03, times=WallTimes(startup_s=8.0, loop_s=2.0, total_s=10.0))
    assert "pure distillation (every reward 0), reverse KL to the teacher (first 5 steps -> last 5): teacher " \
           "'big' 5.400 -> 2.400" in text
    assert "learned" not in text and "learning signal" not in text and "random policy" not in text
    rows = [{**r, "reward/mean": 0.5, "reward/max": 1.0} for r in rows]  # with a reward: both trends
    text = summary_paragraph(rows, baseline=None, times=WallTimes(startup_s=8.0, loop_s=2.0, total_s=10.0))
    assert "the policy did not clearly learn: mean reward 0.500" in text and "teacher 'big' 5.400 -> 2.400" in text


def test_a_short_run_names_its_first_and_last_step():
    rows = [{"step": s, "reward/mean": 0.0, "distill/a/reverse_kl": 1.0 / s} for s in (1, 2)]
    text = summary_paragraph(rows, baseline=None, times=WallTimes(startup_s=8.0, loop_s=2.0, total_s=10.0))
    assert "pure distillation (every reward 0), reverse KL to the teacher (step 1 -> step 2): teacher 'a' 1.000 -> " \
           "0.500" in text
    rows = [{"step": s, "reward/mean": 0.0, "distill/a/full_kl": 1.0 / s} for s in (1, 2)]  # kind: full_kl
    text = summary_paragraph(rows, baseline=None, times=WallTimes(startup_s=8.0, loop_s=2.0, total_s=10.0))
    assert "pure distillation (every reward 0), full-vocabulary KL to the teacher (step 1 -> step 2): teacher 'a' " \
           "1.000 -> 0.500" in text
