"""The distillation term joins the task's advantages in ``Trainer`` (one process, plain torch, ~1 s).

The student and the teacher are the bigram models of tests/test_trainer.py (different draws); the rollouts are
digit games with rewards (step-wise, merged), so the task advantage is not 0: the trainer's advantages must be
exactly the task-only trainer's plus ``-coef * weight * (logp_student - logp_teacher)`` on loss tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_rl.distillation.config import DistillationConfig
from megatron_rl.distillation.signal import Distillation
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output
from megatron_rl.trainer import Trainer
from tests.test_trainer import Bigram, BigramPolicy, make_config, play

COEF, WEIGHT = 0.3, 0.5


def _advantages(trainer: Trainer, out, distillation: Distillation | None):
    batch = trainer.to_training_batch(trainer.validate_and_merge(out, {}))
    trainer.add_old_and_ref_logprobs(batch)
    if distillation is not None:
        distillation.score(batch)
    metrics = trainer.add_advantages(batch)
    return batch, metrics


def test_the_term_is_added_to_the_task_advantage_and_a_step_reports_it():
    student, teacher = BigramPolicy(Bigram(seed=0), lr=0.1), BigramPolicy(Bigram(seed=1), lr=0.0)
    out = episodes_to_generator_output(play(student.model), step_wise=True)
    task_cfg = make_config(merge=True)
    cfg = copy.deepcopy(task_cfg)
    cfg.distillation = DistillationConfig(teachers=[{"name": "t", "hf_path": "/unused", "weight": WEIGHT}], coef=COEF)
    distillation = Distillation(cfg.distillation, [teacher])
    trainer = Trainer(cfg, student, distillation=distillation)

    batch, metrics = _advantages(trainer, out, distillation)
    task, _ = _advantages(Trainer(task_cfg, student), out, None)
    mask = batch["loss_mask"]
    assert task["advantages"].abs().max() > 0.1  # the games' rewards differ within groups
    kl = student.forward(batch)["logprobs"] - teacher.forward(batch)["logprobs"]
    expected = task["advantages"] + torch.where(mask > 0, -COEF * WEIGHT * kl, torch.zeros(()))
    assert torch.allclose(batch["advantages"], expected, atol=1e-6, rtol=0)
    assert metrics["distill/t/reverse_kl"].final() == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-5)

    step = trainer.train_step(out)
    assert step["distill/t/tokens"] == float(mask.sum()) and step["timing/teacher_logprobs_s"] >= 0
    assert step["timing/old_logprobs_skipped"] == 0.0  # two epochs: the old-log-prob forward runs
