"""Micro-batch planning (data/microbatch.py) against brute-force properties and a loop reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data.microbatch import (
    dp_shard_range,
    packed_lengths,
    plan_microbatches,
    restore_order,
    token_budget_microbatches,
)


def _check_plans(plans, lengths, dp_size, cap=None, align=1):
    num_rows = len(lengths)
    padded = packed_lengths(lengths, align)
    assert len({len(p) for p in plans}) == 1, "equal micro-batch counts on every DP rank"
    for d, plan in enumerate(plans):
        start, end = dp_shard_range(num_rows, dp_size, d)
        used = sorted(r for mb in plan for r in mb)
        assert used == list(range(start, end)), "every row of the shard exactly once"
        if cap is not None:
            assert all(sum(padded[r] for r in mb) <= cap for mb in plan), "cap never exceeded"
        assert all(mb == sorted(mb) for mb in plan)


@settings(max_examples=200, deadline=None)
@given(
    dp_size=st.integers(1, 4),
    rows_per_rank=st.integers(1, 6),
    data=st.data(),
    align=st.sampled_from([1, 2, 4]),
)
def test_token_budget_properties(dp_size, rows_per_rank, data, align):
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=dp_size * rows_per_rank,
                                 max_size=dp_size * rows_per_rank))
    cap = data.draw(st.integers(max(packed_lengths(lengths, align)), 120))
    plans = plan_microbatches(lengths, dp_size, max_tokens_per_micro_batch=cap, align=align)
    _check_plans(plans, lengths, dp_size, cap=cap, align=align)
    # Deterministic: every rank computes the same plans from the same global batch.
    assert plans == plan_microbatches(lengths, dp_size, max_tokens_per_micro_batch=cap, align=align)


def test_token_budget_is_first_fit_decreasing():
    # Loop reference of FFD written out by hand: sizes 7,5,4,3,1 into cap 8 -> {7,1}, {5,3}, {4}
    rows = [10, 11, 12, 13, 14]
    lengths = [4, 7, 1, 5, 3]
    bins = token_budget_microbatches(rows, lengths, 8)
    assert sorted(bins) == sorted([[11, 12], [13, 14], [10]])


def test_equal_counts_adds_empty_microbatches():
    # rank 0 rows fit in one micro-batch, rank 1 rows need two.
    plans = plan_microbatches([2, 2, 6, 6], 2, max_tokens_per_micro_batch=8)
    assert plans == [[[0, 1], []], [[2], [3]]]


def test_fixed_rows():
    plans = plan_microbatches([3] * 8, 2, micro_batch_size=3)
    assert plans == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    _check_plans(plans, [3] * 8, 2)


def test_row_longer_than_cap_names_field():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_microbatches([3, 9], 1, max_tokens_per_micro_batch=8)
    # alignment counts: 7 tokens pack to 8 with align 4
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=7"):
        plan_microbatches([7], 1, max_tokens_per_micro_batch=7, align=4)


def test_exactly_one_policy():
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_microbatches([1, 2], 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_microbatches([1, 2], 1, micro_batch_size=1, max_tokens_per_micro_batch=4)


def test_restore_order_roundtrip():
    lengths = [5, 1, 8, 3, 3, 7]
    plans = plan_microbatches(lengths, 2, max_tokens_per_micro_batch=9)
    values = torch.arange(6.0).unsqueeze(1).repeat(1, 3)  # row r holds r
    for d, plan in enumerate(plans):
        start, end = dp_shard_range(6, 2, d)
        outputs = [values[torch.tensor(mb, dtype=torch.long)] for mb in plan]
        torch.testing.assert_close(restore_order(outputs, plan, start), values[start:end], rtol=0, atol=0)
