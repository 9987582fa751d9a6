"""``distillation.kind: full_kl``: the full-vocabulary reverse KL between the student's and its teacher's next-token
distributions on every loss token, a differentiable loss term (docs/DISTILLATION.md).

Place in the data flow: inside the student's update, not before it. ``Trainer.train_mini_batch`` hands
``Distillation.loss_term(mini_batch)`` (a ``FullKLTerm``) to ``MegatronPolicy.forward_backward(logits_term=...)``,
which runs it on the same packed micro-batches (the same ``CallPlan``) as the student:

    forward_backward(mini-batch)         plan_call -> CallPlan (packed THD micro-batches, DP shard)
      -> FullKLTerm.prepare(call)        PP > 1: each teacher's forward over the call (no grad, the teacher's own
                                         pipeline schedule); its last stage keeps each micro-batch's logits
      -> the student's schedule; last stage, loss_head, per micro-batch:
           teacher logits                PP = 1: the teacher's forward on this micro-batch's pack, now (no grad)
             [1, T, Vt/tp] -> the student's vocab layout [1, T, Vs/tp] (equal padded vocabularies: as they are)
           vocab_parallel_kl(student, teacher)  [1, T]: KL(p_s || p_t) over the student's vocabulary
             (model/logprobs.py: reductions over the TP group, local backward; no gradient to the teacher)
           -> [b, R] (to_response) -> per row: coef * weight of its teacher (teacher_ids; 0: none), loss tokens
           -> mb[DISTILL_KL] -> policy_loss_fn adds its token mean over the mini-batch (algorithms/losses.py),
              exactly as the reference KL (use_kl_loss) is normalized; the teacher's logits are then freed
      -> close(): any logits left are dropped

Direction: reverse, ``sum_v p_s(v) (log p_s(v) - log p_t(v))``. It is the quantity whose one-sample estimate on the
sampled token is ``kind: reverse_kl``'s (``E_{y ~ p_s}[log p_s(y) - log p_t(y)]``), so both kinds optimize the
same objective; ``full_kl`` sums it exactly over the vocabulary instead of sampling it (no variance, one
teacher forward per update instead of one per step). Mode-seeking: the student is not pushed to cover teacher
modes it does not sample (the on-policy distillation of Agarwal et al. 2024 and Thinking Machines' recipe).

Vocabulary: both distributions are normalized over the student's ``model.vocab_size`` ids (the ids it samples);
a teacher with more ids (``vocab_size`` >= the student's, ``teachers.check_teachers``) has its extra ids left out.
The two models' Megatron vocab padding (a multiple of TP) may differ: when the teacher's shard width differs from
the student's, the teacher's logits are all-gathered over TP and re-cut to the student's shards (a transient
``tokens x padded vocab`` of the teacher per micro-batch on each TP rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import DISTILL_KL
from megatron_rl.distillation.config import DistillationConfig
from megatron_rl.distillation.offload import OffloadedTeacher
from megatron_rl.metrics import Metric, mean_metric
from megatron_rl.model import schedule
from megatron_rl.model.logprobs import vocab_parallel_kl

Metrics = dict[str, Metric]


class FullKLTerm:
    """The full KL of one mini-batch (``schedule.LogitsTerm``): ``teachers[i]`` is the frozen Megatron model of
    ``config.teachers[i]``, ``teacher_ids`` ``[B]`` each row's teacher (-1: none), ``loss_mask`` ``[B, R]``."""

    def __init__(self, config: DistillationConfig, teachers: Sequence[Any], teacher_ids: torch.Tensor,
                 loss_mask: torch.Tensor) -> None:
        self.config, self.teachers = config, list(teachers)
        rows_with_tokens = loss_mask.sum(dim=1) > 0
        self.rows_of = [set(torch.nonzero((teacher_ids == i) & rows_with_tokens).flatten().tolist())
                        for i in range(len(self.teachers))]
        """Rows (of the mini-batch) each teacher scores; DP padding rows (index >= B) are nobody's."""
        self.stored: dict[tuple[int, int], torch.Tensor] = {}
        """PP > 1: ``(teacher, id(micro-batch)) -> logits [1, T, Vt/tp]`` on the last stage, from ``prepare``."""
        self.pipelined = False

    def weights(self, device: torch.device) -> torch.Tensor:
        """``coef * weight`` per teacher id + 1 (index 0: no teacher, weight 0) ``[n + 1]``."""
        values = [0.0] + [self.config.coef * t.weight for t in self.config.teachers]
        return torch.tensor(values, dtype=torch.float32, device=device)

    def needed(self, item: Any) -> list[int]:
        """The teachers with a row in this micro-batch (the same answer on every rank holding it)."""
        return [i for i, rows in enumerate(self.rows_of) if rows.intersection(item.rows)]

    def prepare(self, call: Any, groups: Any) -> None:
        """PP > 1: each teacher with rows in the mini-batch runs over the whole call (its own pipeline schedule,
        forward only); the last stage keeps every micro-batch's logits until the student's head takes them.
        Every rank first checks the micro-batches carry ``teacher_ids`` (the head reads them on the last stage)."""
        for index, teacher in enumerate(self.teachers):  # offloaded teachers (offload.py): on the device until close
            if self.rows_of[index] and isinstance(teacher, OffloadedTeacher):
                teacher.wake()
        if "teacher_ids" not in call.microbatches[0].tensors:
            raise ValueError("distillation.kind=full_kl needs the batch's 'teacher_ids' [B] (Distillation.score sets "
                             "them); score the batch before forward_backward, or pass GeneratorOutput['teacher_ids']")
        self.pipelined = groups.pp_size > 1
        if not self.pipelined:
            return
        for index, teacher in enumerate(self.teachers):
            if not self.rows_of[index]:
                continue
            with torch.no_grad():
                stores = schedule.run_schedule(teacher.model, call, _keep_logits, groups, forward_only=True)
            for item, store in zip(call.microbatches, stores):  # stores: the last stage only
                self.stored[(index, id(item))] = store["logits"]

    def teacher_logits(self, index: int, item: Any) -> torch.Tensor:
        """Teacher ``index``'s logits ``[1, T, Vt/tp]`` of this micro-batch's pack (PP = 1: its forward now)."""
        if self.pipelined:
            return self.stored.pop((index, id(item)))
        with torch.no_grad():
            logits, _ = schedule.forward_step(iter([item]), self.teachers[index].model, head=_keep_logits)
        return logits

    def __call__(self, item: Any, logits: torch.Tensor, groups: Any, vocab_size: int
                 ) -> tuple[dict[str, torch.Tensor], Metrics]:
        """``{DISTILL_KL: [b, R]}`` (``coef * weight * KL`` on each teacher's rows' loss tokens) and the metrics
        ``distill/<name>/full_kl`` (token mean of the KL over its rows) and ``distill/<name>/tokens``."""
        ids, loss_mask = item.tensors["teacher_ids"], item.tensors["loss_mask"] > 0
        per_row = self.weights(logits.device)[ids + 1]  # [b]
        total = torch.zeros(loss_mask.shape, dtype=torch.float32, device=logits.device)
        metrics: Metrics = {}
        for index in self.needed(item):
            teacher = like_student(self.teacher_logits(index, item), logits.shape[-1], groups)
            kl_tokens = vocab_parallel_kl(logits, teacher, groups.tp_group, valid_vocab_size=vocab_size)  # [1, T]
            del teacher
            mask = loss_mask & (ids == index)[:, None]
            kl = torch.where(mask, schedule.to_response(kl_tokens, item, groups), 0.0)  # [b, R]
            total = total + per_row[:, None] * kl
            name = self.config.teachers[index].name
            metrics[f"distill/{name}/full_kl"] = mean_metric(kl, mask)
            metrics[f"distill/{name}/tokens"] = Metric(mask.sum(), 1.0, "sum")
        return {DISTILL_KL: total}, metrics

    def close(self) -> None:
        """Drop the logits the head did not take (an error mid-schedule); offloaded teachers back to sleep."""
        self.stored.clear()
        for teacher in self.teachers:
            if isinstance(teacher, OffloadedTeacher):
                teacher.sleep()


def _keep_logits(item: Any, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A forward-only head that keeps the micro-batch's logits (the teacher's, PP > 1)."""
    return logits.new_zeros(()), {"logits": logits}


def like_student(teacher: torch.Tensor, width: int, groups: Any) -> torch.Tensor:
    """The teacher's shard ``[..., Vt_pad/tp]`` -> the student's shard layout ``[..., width]`` (``width`` =
    the student's padded vocabulary / tp). Equal widths: the same columns, as they are; otherwise the teacher's
    vocabulary is all-gathered over TP and this rank's student columns cut out (the teacher's padded vocabulary
    is at least the student's: its ``vocab_size`` is)."""
    if teacher.shape[-1] == width:
        return teacher
    if groups.tp_size > 1:
        parts = [torch.empty_like(teacher) for _ in range(groups.tp_size)]
        dist.all_gather(parts, teacher.contiguous(), group=groups.tp_group)
        teacher = torch.cat(parts, dim=-1)
    start = groups.tp_rank * width
    return teacher[..., start:start + width].contiguous()
