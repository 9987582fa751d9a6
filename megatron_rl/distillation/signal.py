"""The distillation signal: teachers' log-probs of the sampled tokens -> a per-token advantage term.

Place in the data flow (megatron_rl/trainer.py): after the old and reference log-probs, before the advantages::

    TrainingBatch [B, S] / [B, R], teacher_ids [B] (each row's teacher, distillation/routing.py)
      -> Distillation.score: each teacher's forward on its rows (frozen, the reference model's path)
                                                                                       teacher_logprobs [B, R]
      -> (the task's token rewards -> advantages -> whitening, unchanged)
      -> Distillation.advantage_term: -coef * weight * (logp_student - logp_teacher)      [B, R], added
      -> per mini-batch normalization (loss_reduction), summed loss: unchanged

The student's log-probs are the policy's before this step's update: ``old_logprobs`` when the trainer ran that
forward, else the rollouts' ``rollout_logprobs`` (what the sampler drew them with; the trainer runs the forward
when the rollouts carry none: ``needs_old_logprobs``). Nothing here is differentiated: the term is an advantage,
so the policy-gradient loss carries it (its gradient is the reverse KL's on the sampled tokens, as in the
on-policy distillation of Agarwal et al. 2024 and Thinking Machines' recipe).

The term is zero outside ``loss_mask`` (observation tokens were not sampled by the student), and the log ratio
is clamped to ``algorithms.kl.KL_LOG_RATIO_CLAMP`` (a teacher that gives a sampled token ~0 probability cannot
make one token's advantage unbounded). It is added after whitening (``algorithm.advantage_whitening`` rescales
the task's advantages only; the reverse KL keeps its own units).

``kind: full_kl`` (distillation/full_kl.py) keeps nothing of this path but the rows' teachers: ``score`` sets
``teacher_ids`` and runs no forward, the advantages are untouched, and ``loss_term`` gives the update its
full-vocabulary KL (the teachers' forward on the update's own micro-batches).

Pure orchestration: the teachers are anything with the policy's ``forward`` (``MegatronPolicy(role='reference')``
built by ``distillation/teachers.py``); no Megatron internal and no ``torch.distributed`` here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl.algorithms.kl import masked_log_ratio
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.distillation.config import DistillationConfig
from megatron_rl.distillation.full_kl import FullKLTerm
from megatron_rl.metrics import Metric, mean_metric

Metrics = dict[str, Metric]

TEACHER_LOGPROBS = "teacher_logprobs/{name}"
"""Batch key of a teacher's per-token log-probs ``[B, R]`` (host, fp32; 0 on rows it does not score)."""
TEACHER_IDS = "teacher_ids"
"""Batch key of each row's teacher ``[B]`` int64 (``GeneratorOutput['teacher_ids']``; -1 = none)."""
UNSCORED_ROWS = "distill/unscored_rows"
"""Metric: rows of the step that no teacher scores (their ``when`` matched none)."""
FORWARD_KEYS = ("sequences", "attention_mask", "response_mask")
"""What a teacher's forward reads of the batch."""


def student_logprobs(batch: TrainingBatch) -> torch.Tensor:
    """The student's log-probs of its sampled tokens ``[B, R]``: ``old_logprobs``, else ``rollout_logprobs``."""
    for key in ("old_logprobs", "rollout_logprobs"):
        if key in batch:
            return batch[key]
    raise ValueError("distillation needs the student's log-probs of the sampled tokens: the batch has neither "
                     "'old_logprobs' nor 'rollout_logprobs' (the Trainer runs the old-log-prob forward when the "
                     "rollouts carry no rollout_logprobs)")


def reverse_kl_term(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-coef * kl, kl)`` per token ``[B, R]`` with ``kl = student - teacher`` (0 where ``mask`` is 0)."""
    kl = masked_log_ratio(student.float(), teacher.float(), mask)
    return -coef * kl, kl


class Distillation:
    """The teachers of ``config`` (``teachers[i]`` is the model of ``config.teachers[i]``) and their signal."""

    def __init__(self, config: DistillationConfig, teachers: Sequence[Any]) -> None:
        if not config.enabled:
            raise ValueError("Distillation needs distillation.teachers; set at least one {name, hf_path}")
        if len(teachers) != len(config.teachers):
            raise ValueError(f"Distillation got {len(teachers)} teacher model(s) for {len(config.teachers)} "
                             "distillation.teachers entries; build one per entry (distillation/teachers.py)")
        self.config = config
        self.teachers = list(teachers)

    def close(self) -> None:
        """Stop the teachers that hold a process (a served teacher's vLLM server); idempotent."""
        for teacher in self.teachers:
            if hasattr(teacher, "close"):
                teacher.close()

    @property
    def in_advantages(self) -> bool:
        """Whether the signal joins the advantages (``kind: reverse_kl``); ``full_kl`` is a loss term instead
        (``loss_term``)."""
        return self.config.kind == "reverse_kl"

    def needs_old_logprobs(self, batch: TrainingBatch) -> bool:
        """Whether the student's log-probs need the old-log-prob forward (reverse_kl, and the rollouts carry none;
        full_kl reads the update's own logits)."""
        return self.in_advantages and "rollout_logprobs" not in batch

    def loss_term(self, mini_batch: TrainingBatch) -> FullKLTerm | None:
        """``kind: full_kl``: the full KL of this mini-batch for ``forward_backward(logits_term=...)``
        (``distillation/full_kl.py``; reads ``teacher_ids``, which ``score`` left in the batch); None otherwise."""
        if self.in_advantages:
            return None
        return FullKLTerm(self.config, self.teachers, self.teacher_ids(mini_batch), mini_batch["loss_mask"])

    def teacher_ids(self, batch: TrainingBatch) -> torch.Tensor:
        """Each row's teacher ``[B]`` (-1 = none): ``batch['teacher_ids']``, else 0 for every row when one
        teacher without ``when`` scores everything; ValueError when routed teachers get rows without ids."""
        if TEACHER_IDS in batch:
            ids = batch[TEACHER_IDS]
            if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= len(self.teachers)):
                raise ValueError(f"GeneratorOutput['teacher_ids'] holds {int(ids.min())}..{int(ids.max())}: give each "
                                 f"row the index of its distillation.teachers entry (0..{len(self.teachers) - 1}) "
                                 "or -1 (none)")
            return ids
        if self.config.routed:
            raise ValueError("distillation.teachers route rows by 'when', but the rollouts carry no "
                             "GeneratorOutput['teacher_ids'] (the single_turn environment fills them from the prompt "
                             "rows' columns); fill one teacher index per sequence, or use one teacher without 'when'")
        return torch.zeros(len(batch), dtype=torch.int64)

    @torch.no_grad()
    def score(self, batch: TrainingBatch) -> Metrics:
        """Each teacher's log-probs of its rows' tokens -> ``batch[TEACHER_LOGPROBS.format(name=...)]`` ``[B, R]``
        (0 on other rows): its forward runs on its rows only (the same rows on every rank; none: no forward).
        ``distill/<name>/time_s`` per teacher and ``distill/unscored_rows``. ``kind: full_kl``: no forward here;
        ``teacher_ids`` is set in the batch (every row's teacher) for the update's ``loss_term``."""
        ids = self.teacher_ids(batch)
        width = batch["response_mask"].shape[1]
        metrics: Metrics = {UNSCORED_ROWS: Metric(float((ids < 0).sum()), 1.0, "sum")}
        if not self.in_advantages:  # full_kl: the teachers run inside the update, on its micro-batches
            batch[TEACHER_IDS] = ids
            return metrics
        for index, (teacher_cfg, teacher) in enumerate(zip(self.config.teachers, self.teachers)):
            start = time.perf_counter()
            rows = torch.nonzero(ids == index).flatten()
            logprobs = torch.zeros((len(batch), width), dtype=torch.float32)
            if len(rows):
                logprobs[rows] = teacher.forward(_rows_of(batch, rows))["logprobs"].to("cpu", torch.float32)
            batch[TEACHER_LOGPROBS.format(name=teacher_cfg.name)] = logprobs
            metrics[f"distill/{teacher_cfg.name}/time_s"] = Metric(time.perf_counter() - start, 1.0, "sum")
        return metrics

    def advantage_term(self, batch: TrainingBatch) -> tuple[torch.Tensor, Metrics]:
        """The sum over teachers of ``-coef * weight * (logp_student - logp_teacher)`` on their rows' loss tokens
        ``[B, R]``, and ``distill/<name>/reverse_kl`` (token mean over its rows) and ``distill/<name>/tokens``. Takes
        the teachers' log-probs and ``teacher_ids`` out of ``batch`` (the update does not read them; each
        micro-batch would copy them to the device)."""
        student, loss_mask = student_logprobs(batch), batch["loss_mask"]
        ids = self.teacher_ids(batch)
        batch.tensors.pop(TEACHER_IDS, None)
        total, metrics = torch.zeros(loss_mask.shape, dtype=torch.float32), {}
        for index, teacher_cfg in enumerate(self.config.teachers):
            teacher = batch.tensors.pop(TEACHER_LOGPROBS.format(name=teacher_cfg.name))
            mask = loss_mask * (ids == index).to(loss_mask.dtype)[:, None]  # its rows' loss tokens
            term, kl = reverse_kl_term(student, teacher, mask, self.config.coef * teacher_cfg.weight)
            total = total + term
            metrics[f"distill/{teacher_cfg.name}/reverse_kl"] = mean_metric(kl, mask)
            metrics[f"distill/{teacher_cfg.name}/tokens"] = Metric(float(mask.sum()), 1.0, "sum")
        return total, metrics


def _rows_of(batch: TrainingBatch, rows: torch.Tensor) -> TrainingBatch:
    """Rows ``rows`` of ``batch``, only the tensors a teacher's forward reads (widths unchanged)."""
    index = rows.tolist()
    return TrainingBatch({k: batch[k][rows] for k in FORWARD_KEYS}, [batch.uids[i] for i in index],
                         [batch.trajectory_ids[i] for i in index], [batch.is_last_step[i] for i in index])
