"""The ``distillation`` section, the start-up checks of a teacher, and the signal's arithmetic (fast, one process).

Cost: ~3 s (two tiny checkpoints written by transformers, no model built)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, MegatronRLConfig, ModelConfig, config_from_dict, load_config
from megatron_rl.config_keys import config_to_dict
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.distillation.config import DistillationConfig
from megatron_rl.distillation.signal import TEACHER_LOGPROBS, Distillation, student_logprobs
from megatron_rl.distillation.teachers import check_teachers
from megatron_rl.trainer import Trainer
from tests.distill.conftest import make_teacher, save_tokenizer

ONE = "distillation.teachers=[{name: big, hf_path: /ckpt/teacher}]"


def test_the_one_liner_loads_and_round_trips():
    cfg = load_config(None, [ONE, "distillation.coef=0.5"])
    (teacher,) = cfg.distillation.teachers
    assert (teacher.name, teacher.hf_path, teacher.weight, teacher.when) == ("big", "/ckpt/teacher", 1.0, None)
    assert cfg.distillation.enabled and cfg.distillation.coef == 0.5 and cfg.distillation.kind == "reverse_kl"
    assert config_from_dict(config_to_dict(cfg)).distillation == cfg.distillation
    assert not MegatronRLConfig().distillation.enabled


@pytest.mark.parametrize("override, message", [
    ("distillation.teachers=[{name: big, hf_pth: /x}]", r"unknown key distillation\.teachers\[0\]\.hf_pth; did you "
                                                        r"mean 'hf_path'\?"),
    ("distillation.teachers=[{hf_path: /x}]", r"distillation\.teachers\[0\]\.name is missing"),
    ("distillation.teachers=[{name: big, hf_path: /x, weight: yes}]", r"distillation\.teachers\[0\]\.weight=True "
                                                                       "must be a number"),
    ("distillation.teachers=[{name: a b, hf_path: /x}]", r"distillation\.teachers\[0\]\.name='a b': use letters"),
    ("distillation.teachers=[{name: a, hf_path: /x, url: 'http://h:1'}]", r"teachers\[0\]\.url='http://h:1' "
                                                                           "attaches a served teacher: set"),
    ("distillation.teachers=[{name: a, hf_path: /x, engine: vllm, url: h:1}]", r"teachers\[0\]\.url='h:1' is not a "
                                                                                "server URL"),
    ("distillation.teachers=[{name: a, hf_path: /x, offload: 1}]", r"teachers\[0\]\.offload=1 must be true or false"),
    ("distillation.teachers=[{name: a, hf_path: /x, engine: vllm, offload: true}]", r"teachers\[0\]\.offload=true "
                                                                                     "with engine: vllm"),
    ("distillation.teachers=[{name: a, hf_path: /x}, {name: a, hf_path: /y}]", r"teachers\[1\]\.name='a' is used "
                                                                                "twice"),
    ("distillation.teachers=[{name: a, hf_path: /x}, {name: b, hf_path: /y}]", r"teachers\[0\]\.when is unset but "
                                                                                "there are 2 teachers"),
    ("distillation.teachers=[big]", r"distillation\.teachers\[0\]='big' must be a mapping"),
    ("distillation.teachers=[{name: a, hf_path: /x, engine: vllm}]\ndistillation.kind=full_kl",
     r"distillation\.teachers\[0\]\.engine='vllm' with distillation\.kind=full_kl: a server returns log-probs of "
     "given tokens, not full distributions; use engine: megatron"),
    ("distillation.coef=-1", r"distillation\.coef=-1\.0 is out of range"),
])
def test_mistakes_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split("\n"))


def _with_teacher(path, **model) -> MegatronRLConfig:
    return MegatronRLConfig(model=ModelConfig(**model),
                            distillation=DistillationConfig(teachers=[{"name": "t", "hf_path": str(path)}]))


def test_a_teacher_that_cannot_score_the_students_tokens_is_one_line_at_start_up(tmp_path, teacher_dir):
    check_teachers(_with_teacher(teacher_dir))  # vocabulary 129 >= the student's 128
    key = r"distillation\.teachers\[0\]\.hf_path="
    with pytest.raises(ConfigError, match=key + ".*vocab_size 129 is smaller than the student's 200"):
        check_teachers(_with_teacher(teacher_dir, vocab_size=200))
    with pytest.raises(ConfigError, match=key + ".*has no config.json"):
        check_teachers(_with_teacher(tmp_path / "missing"))
    student = tmp_path / "student"
    student.mkdir()
    save_tokenizer(student, 128)
    same = make_teacher(tmp_path / "same", tokenizer_vocab=128)
    other = make_teacher(tmp_path / "other", tokenizer_vocab=128, shift_tokens=True)
    check_teachers(_with_teacher(same, hf_path=str(student)))
    with pytest.raises(ConfigError, match=key + r".*tokenizer is not the student's \(2 token\(s\) differ, e.g. 't1': "
                                                "id 1 in the student, 2 in the teacher\\)") as info:
        check_teachers(_with_teacher(other, hf_path=str(student)))
    assert "\n" not in str(info.value)


def test_full_kl_under_context_parallelism_is_refused_at_start_up(teacher_dir):
    from megatron_rl.config import ParallelConfig

    config = _with_teacher(teacher_dir)
    full = DistillationConfig(teachers=[{"name": "t", "hf_path": str(teacher_dir)}], kind="full_kl")
    check_teachers(MegatronRLConfig(distillation=full))
    with pytest.raises(ConfigError, match=r"distillation\.kind=full_kl with parallel\.context_parallel_size=2 is "
                                          r"not supported yet .*; set parallel\.context_parallel_size=1"):
        check_teachers(MegatronRLConfig(parallel=ParallelConfig(context_parallel_size=2), distillation=full))
    check_teachers(MegatronRLConfig(parallel=ParallelConfig(context_parallel_size=2),
                                    distillation=config.distillation))  # reverse_kl: fine


def _batch(student, teacher, loss_mask, **extra) -> TrainingBatch:
    rows = len(loss_mask)
    tensors = {"loss_mask": loss_mask, TEACHER_LOGPROBS.format(name="t"): teacher, **extra}
    if student is not None:
        tensors["old_logprobs"] = student
    return TrainingBatch(tensors, list(range(rows)), list(range(rows)), [True] * rows)


def test_the_term_is_minus_coef_weight_times_the_log_ratio_on_loss_tokens():
    g = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    config = DistillationConfig(teachers=[{"name": "t", "hf_path": "/x", "weight": 0.5}], coef=0.3)
    batch = _batch(student, teacher, mask)
    term, metrics = Distillation(config, [None]).advantage_term(batch)
    assert TEACHER_LOGPROBS.format(name="t") not in batch  # taken out: the update does not copy it per micro-batch
    expected = torch.where(mask > 0, -0.3 * 0.5 * (student - teacher), torch.zeros(()))
    assert torch.allclose(term, expected, atol=1e-7, rtol=0)
    kl = ((student - teacher) * mask).sum() / mask.sum()
    assert metrics["distill/t/reverse_kl"].final() == pytest.approx(float(kl), rel=1e-6)
    assert metrics["distill/t/tokens"].final() == float(mask.sum())
    shifted = torch.roll(teacher, 1, dims=1)  # an off-by-one between the teacher's tokens and the student's
    wrong, _ = Distillation(config, [None]).advantage_term(_batch(student, shifted, mask))
    assert (wrong - expected).abs().max() > 1e-2


def test_the_students_logprobs_are_the_old_ones_else_the_rollouts():
    mask = torch.ones(2, 3)
    old, rollout = torch.full((2, 3), -1.0), torch.full((2, 3), -2.0)
    assert student_logprobs(_batch(old, old, mask, rollout_logprobs=rollout)) is old
    assert student_logprobs(_batch(None, old, mask, rollout_logprobs=rollout)) is rollout
    with pytest.raises(ValueError, match="neither 'old_logprobs' nor 'rollout_logprobs'"):
        student_logprobs(_batch(None, old, mask))
    distillation = Distillation(DistillationConfig(teachers=[{"name": "t", "hf_path": "/x"}]), [None])
    assert distillation.needs_old_logprobs(_batch(None, old, mask))
    assert not distillation.needs_old_logprobs(_batch(None, old, mask, rollout_logprobs=rollout))
    full = Distillation(DistillationConfig(teachers=[{"name": "t", "hf_path": "/x"}], kind="full_kl"), [None])
    assert not full.needs_old_logprobs(_batch(None, old, mask))  # full_kl reads the update's own logits


def test_the_trainer_takes_teachers_exactly_when_the_config_names_them():
    with pytest.raises(ValueError, match=r"distillation\.teachers and Trainer\(distillation=\.\.\.\) go together"):
        Trainer(load_config(None, [ONE]), policy=None)
    config = DistillationConfig(teachers=[{"name": "t", "hf_path": "/x"}])
    with pytest.raises(ValueError, match="go together"):
        Trainer(MegatronRLConfig(), policy=None, distillation=Distillation(config, [None]))


def test_a_relative_teacher_path_is_taken_from_where_the_user_stands(tmp_path, monkeypatch):
    from megatron_rl.job.config import load_job_config
    from megatron_rl.job.paths import CALLER_CWD_ENV

    monkeypatch.setenv(CALLER_CWD_ENV, str(tmp_path))
    for given, expected in (("ckpt/teacher", str(tmp_path / "ckpt" / "teacher")), ("/abs/t", "/abs/t")):
        overrides = ["model.vocab_size=16", f"distillation.teachers=[{{name: t, hf_path: {given}}}]"]
        config = load_job_config(None, overrides)
        assert config.rl.distillation.teachers[0].hf_path == expected
