"""The Megatron stage: megatron-core's pipeline schedule over a ``CallPlan`` and the heads run on its output.

Place in the data flow (docs/DESIGN.md section 1): between ``model/plan.py`` (packed micro-batches on the device)
and the policy's results. Every function here is module-level and named for its stage:

    run_schedule(model, call, head, groups)  get_forward_backward_func over call.microbatches
      forward_step(iterator, model, head)    GPTModel(input_ids, position_ids, packed_seq_params) -> logits
      last PP stage: head(item, logits)      [1, T, V/tp] ->
        forward_head      response logprobs / entropy [b, R]           (MegatronPolicy.forward)
        next_token_head   full-vocab log-softmax after each row [b, V] (MegatronPolicy.next_token_logprobs)
        loss_head         loss_fn(...) scaled for Megatron (model/scaling.py)  (MegatronPolicy.forward_backward)
    gather_rows(call, rows, groups)          last stage's shard -> every rank, all DP rows, on the host

A head returns ``(loss, reported)``; the schedule collects ``reported`` per micro-batch on the last stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_rl.data.packing import unpack_response
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.metrics import Metric
from megatron_rl.model import moe, scaling
from megatron_rl.model.context_parallel import gather_tokens, select_positions
from megatron_rl.model.logprobs import vocab_parallel_log_softmax, vocab_parallel_logprobs_entropy
from megatron_rl.model.plan import CallPlan, MicroBatch
from megatron_rl.model.router_replay import ReplayCall

LossFn = Callable[[torch.Tensor, torch.Tensor | None, Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, dict]]
"""``loss_fn(logprobs [b,R], entropy [b,R] | None, mb_tensors, loss_config) -> (summed_loss, dict[str, Metric])``;
``loss_config`` is passed through untouched (docs/INTERFACES.md, algorithms/)."""

Head = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]
"""``head(item, logits [1, T, V/tp]) -> (loss, reported)``: what the last stage does with a micro-batch."""


class LogitsTerm(Protocol):
    """Per-token tensors for ``loss_fn`` computed from a micro-batch's logits beside the log-probs (on-policy
    distillation's ``full_kl``: distillation/full_kl.py). ``MegatronPolicy.forward_backward(logits_term=...)``
    calls ``prepare`` on every rank after planning (a forward of other models over the same call may run
    there), the term in ``loss_head`` on the last stage (its tensors join ``item.tensors`` for ``loss_fn``, its
    metrics the loss's), and ``close`` after the schedule."""

    def prepare(self, call: CallPlan, groups: ParallelGroups) -> None: ...

    def __call__(self, item: MicroBatch, logits: torch.Tensor, groups: ParallelGroups, vocab_size: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Metric]]: ...

    def close(self) -> None: ...


def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module, *, head: Head,
                 moe_tokens: moe.CallTokens | None = None, replay: ReplayCall | None = None):
    """megatron-core's ``forward_step_func``: one packed micro-batch through this rank's model chunk (an MoE
    model's routers learn which sequence each token belongs to, model/moe.py, and replay or record their
    routing, model/router_replay.py)."""
    item = next(data_iterator)
    p = item.model_pack  # this CP rank's tokens under context parallelism
    with (moe.tokens_of(moe_tokens.for_micro_batch(item) if moe_tokens is not None else None),
          replay.micro_batch(item) if replay is not None else contextlib.nullcontext()):
        output = model(p.input_ids, p.position_ids, None, packed_seq_params=p.packed_seq_params())
    return output, partial(head, item)


def run_schedule(
    model: torch.nn.Module, call: CallPlan, head: Head, groups: ParallelGroups, *, forward_only: bool,
    moe_tokens: moe.CallTokens | None = None, replay: ReplayCall | None = None,
) -> list[dict]:
    """megatron-core's schedule over this rank's micro-batches; returns what ``head`` reported (last stage).

    Process groups are explicit (``pg_collection``), which megatron-core pairs with an explicit p2p communicator.
    A forward-only call on one pipeline stage skips the schedule (``_forward_only``).
    """
    step = partial(forward_step, head=head, moe_tokens=moe_tokens, replay=replay)
    if forward_only and groups.pp_size == 1:
        return _forward_only(model, call, step)
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(call.microbatches),
        model=[model],
        num_microbatches=len(call.microbatches),
        seq_length=call.seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
        pg_collection=groups.pg_collection,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp_group, config=model.config),
    )


def _forward_only(model: torch.nn.Module, call: CallPlan, step) -> list[dict]:
    """What megatron-core's ``forward_backward_no_pipelining(forward_only=True)`` returns, without its per-call
    set-up (its checks, contexts and loss scaling are for a backward; ~8 % of a tiny model's decoding forward,
    17 of which make a rollout of 16 tokens): each micro-batch through ``step`` and its head under no_grad, the
    head's report stored (``schedules.forward_step_calc_loss``: the last stage appends the loss function's second
    output). One stage only: nothing to send or receive."""
    data = iter(call.microbatches)
    store = []
    with torch.no_grad():
        for _ in call.microbatches:
            output, head = step(data, model)
            store.append(head(output)[1])
    return store


def token_outputs(
    item: MicroBatch, logits: torch.Tensor, groups: ParallelGroups, vocab_size: int, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Last stage: logits ``[1, T, V/tp]`` -> response logprobs / entropy ``[b, R]`` (fp32).

    Context parallelism: logits are ``[1, T/cp, V/tp]``; the per-token values are gathered over CP to the whole
    pack (backward: this rank's slice), so every CP rank unpacks and computes the same micro-batch loss."""
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, item.model_pack.labels, groups.tp_group, compute_entropy, valid_vocab_size=vocab_size
    )
    return to_response(logprobs, item, groups), (to_response(entropy, item, groups) if entropy is not None else None)


def to_response(per_token: torch.Tensor, item: MicroBatch, groups: ParallelGroups) -> torch.Tensor:
    """Per-token values of this rank's model pack ``[1, T]`` (``[1, T/cp]`` under CP, gathered to the whole
    pack first; backward: this rank's slice) -> right-aligned response values ``[b, R]``."""
    if item.cp_local is not None:
        per_token = gather_tokens(per_token, item.cp_local, groups.cp_group)
    return unpack_response(per_token, item.packed, item.tensors["response_mask"].shape[1])


def forward_head(
    item: MicroBatch, logits: torch.Tensor, *, groups: ParallelGroups, vocab_size: int, compute_entropy: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``{"logprobs": [b, R]}`` (+ ``"entropy"``) of the micro-batch's real rows (a dummy has none)."""
    logprobs, entropy = token_outputs(item, logits, groups, vocab_size, compute_entropy)
    rows = len(item.rows)  # 0 for a dummy micro-batch: its outputs are dropped
    out = {"logprobs": logprobs[:rows]}
    if entropy is not None:
        out["entropy"] = entropy[:rows]
    return logits.new_zeros(()), out


def next_token_head(
    item: MicroBatch, logits: torch.Tensor, *, groups: ParallelGroups, vocab_size: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Last stage: logits ``[1, T, V/tp]`` -> full-vocab log-probs after each row's last token ``[b, V]``."""
    packed = item.packed
    last = (packed.cu_seqlens[: packed.num_rows] + packed.seq_lens - 1).long()  # [b] last valid token
    if item.cp_local is None:
        rows = logits[0, last]
    else:  # the rank holding each row's last token contributes it
        rows = select_positions(logits[0], last, item.cp_local, groups.cp_group)
    logprobs = vocab_parallel_log_softmax(rows, groups.tp_group, valid_vocab_size=vocab_size)  # [b, V]
    return logits.new_zeros(()), {"next_token_logprobs": logprobs[: len(item.rows)]}  # dummy: 0 rows


def loss_head(
    item: MicroBatch, logits: torch.Tensor, *, groups: ParallelGroups, vocab_size: int, loss_fn: LossFn,
    loss_config: Any, compute_entropy: bool, num_microbatches: int, logits_term: LogitsTerm | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:  # fmt: skip
    """``loss_fn`` on the micro-batch, scaled so Megatron's gradient is that of the summed loss (scaling.py);
    ``logits_term``'s tensors join the micro-batch's for ``loss_fn``, its metrics the loss's."""
    logprobs, entropy = token_outputs(item, logits, groups, vocab_size, compute_entropy)
    tensors, extra = item.tensors, {}
    if logits_term is not None:
        added, extra = logits_term(item, logits, groups, vocab_size)
        tensors = {**tensors, **added}
    summed, metrics = loss_fn(logprobs, entropy, tensors, loss_config)
    return megatron_loss(item, logprobs, (summed, {**metrics, **extra}), groups, num_microbatches)


def megatron_loss(
    item: MicroBatch, outputs: torch.Tensor, loss: tuple[torch.Tensor, dict[str, Metric]], groups: ParallelGroups,
    num_microbatches: int,
) -> tuple[torch.Tensor, dict[str, Metric]]:  # fmt: skip
    """A head's ``(summed, metrics)`` from ``loss_fn`` -> the 2-tuple for megatron-core (model/scaling.py)."""
    summed, metrics = loss
    if not summed.requires_grad:  # e.g. a loss that returns a constant for an all-masked micro-batch
        summed = summed + 0.0 * outputs.sum()  # keeps the graph (and a zero gradient) through ``outputs``
    reported = metrics if item.rows else {}  # a dummy micro-batch's metrics would skew max/min
    return scaling.scale_loss_for_megatron(
        summed, reported, num_microbatches=num_microbatches, dp_size=groups.dp_size
    )


@torch.no_grad()
def dry_run_loss(call: CallPlan, loss_fn: LossFn, loss_config: Any, compute_entropy: bool) -> None:
    """Run ``loss_fn`` once on zero log-probs of the first micro-batch, on every rank, before the schedule.

    Inside the schedule the loss runs on the last pipeline stage only: an error there (a missing batch key,
    a bad config) would leave the other stages waiting forever for its gradient. Here every rank raises.
    """
    tensors = call.microbatches[0].tensors
    zeros = torch.zeros_like(tensors["response_mask"], dtype=torch.float32)  # [b, R]
    loss_fn(zeros, zeros if compute_entropy else None, tensors, loss_config)


def gather_rows(
    call: CallPlan, local: torch.Tensor | None, row_shape: tuple[int, ...], groups: ParallelGroups
) -> torch.Tensor:
    """Shard ``[B/dp, *row_shape]`` on the last PP stage -> ``[B, *row_shape]`` on every rank, on the host,
    padding rows stripped (``row_shape`` e.g. ``(R, k)``). ``local`` is None off the last stage."""
    shape = (call.shard_rows, *row_shape)
    if local is None:
        local = torch.empty(shape, dtype=torch.float32, device=groups.device)
    local = local.contiguous()
    assert tuple(local.shape) == shape, (tuple(local.shape), shape)
    pp_group = groups.pp_group
    if groups.pp_size > 1:
        dist.broadcast(local, src=dist.get_global_rank(pp_group, groups.pp_size - 1), group=pp_group)
    if groups.dp_size > 1:
        parts = [torch.empty_like(local) for _ in range(groups.dp_size)]
        dist.all_gather(parts, local, group=groups.dp_group)
        local = torch.cat(parts, dim=0)
    return local[: call.num_rows].cpu()


# --------------------------------------------------------------------------------------------------------------
# Value heads (the critic, model/critic.py): the output is [1, T, 1] scalar values instead of vocab logits
# --------------------------------------------------------------------------------------------------------------

def token_values(item: MicroBatch, output: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Last stage: the value head's output ``[1, T, 1]`` -> response values ``[b, R]`` (fp32), right-aligned with
    the log-probs' convention (column k: V of the state before response token k; docs/DESIGN.md section 13)."""
    return to_response(output[..., 0].float(), item, groups)


def values_head(item: MicroBatch, output: torch.Tensor, *, groups: ParallelGroups
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``{"values": [b, R]}`` of the micro-batch's real rows (a dummy has none)."""
    return output.new_zeros(()), {"values": token_values(item, output, groups)[: len(item.rows)]}


def value_loss_head(
    item: MicroBatch, output: torch.Tensor, *, groups: ParallelGroups, loss_fn: LossFn, loss_config: Any,
    num_microbatches: int,
) -> tuple[torch.Tensor, dict[str, Metric]]:  # fmt: skip
    """``loss_fn(values [b, R], None, mb, loss_config)``, scaled like ``loss_head`` (model/scaling.py)."""
    values = token_values(item, output, groups)
    return megatron_loss(item, values, loss_fn(values, None, item.tensors, loss_config), groups, num_microbatches)
