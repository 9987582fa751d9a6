"""Micro-batch planning: which rows of a DP-padded global batch go into which micro-batch on which DP rank.

Place in the data flow (docs/DESIGN.md section 1): inside the policy (``model/plan.py``), after DP padding
(the global batch has ``B`` rows, a multiple of ``dp_size``) and before packing. Pure functions of ints; no
torch.distributed. Every rank computes the plans of *all* DP ranks from the same global batch, so micro-batch
counts agree without a collective.

    global rows    0 .. B-1            DP rank d owns the contiguous shard [d*B/dp, (d+1)*B/dp)
    plan[d]        list of micro-batches, each a list of *global* row indices (possibly empty)
    len(plan[d])   identical for every d: ranks with fewer micro-batches get empty ones appended
                   (the backend runs them as a dummy row with loss_mask 0)

Two policies:
  - fixed rows: ``micro_batch_size`` consecutive rows per micro-batch;
  - token budget: packed lengths (valid tokens rounded up to ``align``) are bin-packed first-fit-decreasing
    under a hard cap ``max_tokens_per_micro_batch``; a single row above the cap is a ValueError. The setting
    ``"auto"`` (``AUTO_TOKEN_BUDGET``) is resolved to a number by the policy before planning
    (``model/token_budget.py``: from the model and the memory, never below the call's longest row).
Outputs computed per micro-batch are put back into row order with ``restore_order``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MicroBatchPlan = list[list[int]]  # micro-batches of global row indices for one DP rank
AUTO_TOKEN_BUDGET = "auto"
"""``batch.max_tokens_per_micro_batch`` derived per call (model/token_budget.py), never refusing a row."""


def dp_shard_range(num_rows: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Contiguous ``[start, end)`` rows of DP rank ``dp_rank``; ``num_rows`` must be a multiple of dp_size."""
    assert num_rows % dp_size == 0, f"pad the batch to a multiple of dp_size first ({num_rows} % {dp_size})"
    per_rank = num_rows // dp_size
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


def packed_lengths(valid_lengths: Sequence[int], align: int) -> list[int]:
    """Tokens each row occupies in a packed stream: its valid length rounded up to a multiple of ``align``."""
    assert align >= 1, align
    return [-(-int(n) // align) * align for n in valid_lengths]


def check_microbatch_rule(micro_batch_size: int | None, max_tokens_per_micro_batch: int | str | None) -> None:
    """The micro-batch rule, checked here only: exactly one of fixed rows / token budget, and it is >= 1 (or
    the budget is ``"auto"``).

    ``config.batch`` validation and ``plan_microbatches`` both call this (one source of the messages).
    """
    if (micro_batch_size is None) == (max_tokens_per_micro_batch is None):
        raise ValueError(
            f"set exactly one of batch.micro_batch_size ({micro_batch_size}) and "
            f"batch.max_tokens_per_micro_batch ({max_tokens_per_micro_batch}); set the other to null"
        )
    for name, value in (("micro_batch_size", micro_batch_size), ("max_tokens_per_micro_batch",
                                                                  max_tokens_per_micro_batch)):
        if isinstance(value, str):
            if name == "max_tokens_per_micro_batch" and value == AUTO_TOKEN_BUDGET:
                continue
            raise ValueError(f"batch.{name}={value!r} is not a number; set a positive integer"
                             + (" or 'auto'" if name == "max_tokens_per_micro_batch" else ""))
        if value is not None and value < 1:
            raise ValueError(f"batch.{name}={value} must be >= 1; set a positive value or null (and set the other)")


def fixed_size_microbatches(rows: Sequence[int], micro_batch_size: int) -> MicroBatchPlan:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter; rule checked by the caller)."""
    assert micro_batch_size >= 1, micro_batch_size
    rows = list(rows)
    return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


def token_budget_microbatches(rows: Sequence[int], lengths: Sequence[int], max_tokens: int) -> MicroBatchPlan:
    """First-fit-decreasing bins of ``rows`` whose ``lengths`` (packed tokens) sum to at most ``max_tokens``.

    Bins keep their rows in ascending row order (deterministic, and packing order does not matter).
    """
    assert len(rows) == len(lengths), (len(rows), len(lengths))
    for row, n in zip(rows, lengths):
        if n > max_tokens:
            raise ValueError(
                f"batch.max_tokens_per_micro_batch={max_tokens} is smaller than row {row}, which packs to {n} "
                f"tokens; raise batch.max_tokens_per_micro_batch to at least {n} (or shorten the sequences)"
            )
    bins: list[list[int]] = []
    loads: list[int] = []
    # Stable sort: equal lengths keep row order, so the plan is a pure function of the input.
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(rows[i])
                loads[b] += lengths[i]
                break
        else:
            bins.append([rows[i]])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def plan_microbatches(
    valid_lengths: Sequence[int],
    dp_size: int,
    *,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
    align: int = 1,
) -> list[MicroBatchPlan]:
    """Plans of every DP rank for a DP-padded global batch, with equal micro-batch counts.

    valid_lengths: ``[B]`` valid tokens per row (attention_mask sums), ``B % dp_size == 0``.
    Exactly one of ``micro_batch_size`` / ``max_tokens_per_micro_batch`` is set.
    Returns ``plans[d]``: DP rank d's micro-batches of global row indices; shorter plans are padded with ``[]``.
    """
    check_microbatch_rule(micro_batch_size, max_tokens_per_micro_batch)
    assert max_tokens_per_micro_batch != AUTO_TOKEN_BUDGET, "resolve 'auto' first (model/token_budget.py)"
    lengths = packed_lengths(valid_lengths, align)
    plans = []
    for d in range(dp_size):
        start, end = dp_shard_range(len(lengths), dp_size, d)
        rows = range(start, end)
        if micro_batch_size is not None:
            plans.append(fixed_size_microbatches(rows, micro_batch_size))
        else:
            plans.append(token_budget_microbatches(rows, lengths[start:end], max_tokens_per_micro_batch))
    num_microbatches = max(1, max(len(p) for p in plans))
    return [p + [[] for _ in range(num_microbatches - len(p))] for p in plans]


def restore_order(outputs: Sequence[torch.Tensor], plan: MicroBatchPlan, first_row: int) -> torch.Tensor:
    """Stack per-micro-batch outputs back into row order.

    outputs[k]: ``[len(plan[k]), ...]`` for micro-batch k (empty micro-batches contribute ``[0, ...]``).
    Returns ``[num_rows, ...]`` where row ``r - first_row`` holds global row r's output.
    """
    rows = [r for mb in plan for r in mb]
    assert len(outputs) == len(plan) and sum(o.shape[0] for o in outputs) == len(rows)
    stacked = torch.cat(list(outputs), dim=0)
    order = torch.tensor(rows, dtype=torch.long) - first_row
    assert sorted(order.tolist()) == list(range(len(rows))), "plan must cover the shard exactly once"
    result = torch.empty_like(stacked)
    result[order] = stacked
    return result
