"""Prompt-based mini-batch boundaries (docs/DESIGN.md section 6)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import compute_prompt_end_indices, compute_prompt_mini_batch_boundaries


def test_hand_example():
    uids = ["a", "a", "a", "b", "b", "c", "c", "c", "c", "d"]
    assert compute_prompt_end_indices(uids) == [3, 5, 9, 10]
    assert compute_prompt_mini_batch_boundaries(uids, 2) == [(0, 5), (5, 10)]
    assert compute_prompt_mini_batch_boundaries(uids, 1) == [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert compute_prompt_mini_batch_boundaries(uids, 4) == [(0, 10)]
    assert compute_prompt_end_indices([]) == []


@pytest.mark.parametrize(
    "uids, mini_batch_size, match",
    [
        (["a", "b", "a"], 1, r"uids\[2\] = 'a' reappears"),
        (["a", "a", "b", "c", "c"], 2, "3 prompts, not a multiple of mini_batch_size=2"),
        (["a"], 0, "mini_batch_size=0 must be >= 1"),
    ],
)
def test_bad_input(uids, mini_batch_size, match):
    with pytest.raises(ValueError, match=match):
        compute_prompt_mini_batch_boundaries(uids, mini_batch_size)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 5))
def test_non_step_wise_equals_fixed_slicing(num_mini_batches, mini_batch_size, samples_per_prompt):
    num_prompts = num_mini_batches * mini_batch_size
    uids = [f"p{i // samples_per_prompt}" for i in range(num_prompts * samples_per_prompt)]
    rows = mini_batch_size * samples_per_prompt
    expected = [(s, s + rows) for s in range(0, len(uids), rows)]
    assert compute_prompt_mini_batch_boundaries(uids, mini_batch_size) == expected


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12), st.integers(1, 4))
def test_boundaries_partition_with_exact_prompt_counts(run_lengths, mini_batch_size):
    run_lengths = run_lengths[: len(run_lengths) // mini_batch_size * mini_batch_size] or [1] * mini_batch_size
    uids = [prompt for prompt, n in enumerate(run_lengths) for _ in range(n)]
    bounds = compute_prompt_mini_batch_boundaries(uids, mini_batch_size)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(uids)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(bounds, bounds[1:]))
    for start, end in bounds:
        assert len(set(uids[start:end])) == mini_batch_size
