"""merge_stepwise_output: the three observation cases, no-merge cases, carried values, loop reference."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import merge_stepwise_output, validate_generator_output


def steps(*rows, trajectory_ids=None, uids=None):
    """Step-wise GeneratorOutput from (prompt, response, loss_mask, logprobs, reward) tuples."""
    n = len(rows)
    trajectory_ids = trajectory_ids or ["t"] * n
    return {
        "prompt_token_ids": [r[0] for r in rows],
        "response_ids": [r[1] for r in rows],
        "loss_masks": [r[2] for r in rows],
        "rollout_logprobs": [r[3] for r in rows],
        "rewards": [r[4] for r in rows],
        "uids": uids or ["u"] * n,
        "trajectory_ids": trajectory_ids,
        "is_last_step": [i == n - 1 or trajectory_ids[i + 1] != trajectory_ids[i] for i in range(n)],
        "stop_reasons": [f"s{i}" for i in range(n)],
    }


MERGED_TWO_TURNS = {
    "prompt_token_ids": [[1, 2]],
    "response_ids": [[3, 4, 5, 6, 7]],
    "loss_masks": [[1, 1, 0, 0, 1]],
    "rollout_logprobs": [[-1.0, -2.0, 0.0, 0.0, -3.0]],
    "rewards": [1.0],
    "uids": ["u"],
    "trajectory_ids": ["t"],
    "is_last_step": [True],
    "stop_reasons": ["s1"],
}


@pytest.mark.parametrize(
    "first_step",
    [
        ([1, 2], [3, 4], [1, 1], [-1.0, -2.0], 0.0),  # observation only in the next prompt
        ([1, 2], [3, 4, 5, 6], [1, 1, 0, 0], [-1.0, -2.0, 0.0, 0.0], 0.0),  # observation already in the response
        ([1, 2], [3, 4, 5], [1, 1, 0], [-1.0, -2.0, 0.0], 0.0),  # both
    ],
    ids=["obs_in_prompt", "obs_in_response", "both"],
)
def test_three_observation_cases(first_step):
    out = steps(first_step, ([1, 2, 3, 4, 5, 6], [7], [1], [-3.0], 1.0))
    merged, counts = merge_stepwise_output(out)
    assert merged == MERGED_TWO_TURNS
    assert counts == {"num_seq_before_merge": 2, "num_seq_after_merge": 1}


@pytest.mark.parametrize(
    "second_prompt",
    [[1, 2, 3, 9, 5, 6], [1, 2, 3]],  # mismatch; prompt+response of step 0 is a prefix of prompt+response only
    ids=["mismatch", "prefix_of_prompt_plus_response_only"],
)
def test_no_merge(second_prompt):
    second_response = [4, 5] if len(second_prompt) == 3 else [7]
    num = len(second_response)
    out = steps(
        ([1, 2], [3, 4], [1, 1], [-1.0, -2.0], 0.0),
        (second_prompt, second_response, [1] * num, [-3.0] * num, 1.0),
    )
    merged, counts = merge_stepwise_output(out)
    assert counts["num_seq_after_merge"] == 2
    assert merged["response_ids"] == out["response_ids"]
    assert merged["is_last_step"] == [False, True]


def test_never_merges_across_trajectories():
    out = steps(([1, 2], [3], [1], [-1.0], 0.5), ([1, 2, 3, 4], [5], [1], [-2.0], 1.0), trajectory_ids=["a", "b"])
    merged, counts = merge_stepwise_output(out)
    assert counts["num_seq_after_merge"] == 2 and merged["is_last_step"] == [True, True]


def test_partial_merges_within_one_trajectory_and_per_token_rewards():
    out = steps(
        ([1], [2], [1], [-1.0], [0.5]),
        ([1, 2, 3], [4], [1], [-2.0], [0.0]),  # extends step 0 (observation [3])
        ([1, 2, 3, 40], [5], [1], [-3.0], [0.25]),  # re-tokenized history: starts a new group
        ([1, 2, 3, 40, 5], [6, 7], [1, 1], [-4.0, -5.0], [0.0, 1.0]),  # extends step 2 (empty observation)
    )
    merged, counts = merge_stepwise_output(out)
    assert counts == {"num_seq_before_merge": 4, "num_seq_after_merge": 2}
    assert merged["prompt_token_ids"] == [[1], [1, 2, 3, 40]]
    assert merged["response_ids"] == [[2, 3, 4], [5, 6, 7]]
    assert merged["loss_masks"] == [[1, 0, 1], [1, 1, 1]]
    assert merged["rollout_logprobs"] == [[-1.0, 0.0, -2.0], [-3.0, -4.0, -5.0]]
    assert merged["rewards"] == [[0.5, 0.0, 0.0], [0.25, 0.0, 1.0]]
    assert merged["is_last_step"] == [False, True] and merged["trajectory_ids"] == ["t", "t"]
    assert merged["stop_reasons"] == ["s1", "s3"]
    validate_generator_output(merged, step_wise=True)


def test_scalar_reward_from_last_step_and_no_logprobs():
    out = steps(([1], [2], [1], None, 0.3), ([1, 2], [3], [1], None, 0.9))
    del out["rollout_logprobs"]
    merged, _ = merge_stepwise_output(out)
    assert merged["rewards"] == [0.9] and "rollout_logprobs" not in merged


def test_mixed_reward_kinds_in_one_group_rejected():
    out = steps(([1], [2], [1], [-1.0], 0.0), ([1, 2], [3], [1], [-1.0], [1.0]))
    with pytest.raises(ValueError, match=r"\['rewards'\]\[1\] is per-token"):
        merge_stepwise_output(out)


def test_invalid_input_rejected():
    out = steps(([1], [2], [1], [-1.0], 0.0))
    out["is_last_step"] = [False]
    with pytest.raises(ValueError, match="is_last_step"):
        merge_stepwise_output(out)


def reference_merge(out):
    """Naive loop: concatenate histories, compare element by element."""
    rows = []
    for i in range(len(out["prompt_token_ids"])):
        prompt, response = out["prompt_token_ids"][i], out["response_ids"][i]
        if rows and rows[-1]["tid"] == out["trajectory_ids"][i]:
            history = rows[-1]["prompt"] + rows[-1]["response"]
            if len(prompt) >= len(history) and all(prompt[j] == history[j] for j in range(len(history))):
                obs = prompt[len(history):]
                rows[-1]["response"] = rows[-1]["response"] + obs + response
                rows[-1]["mask"] = rows[-1]["mask"] + [0 for _ in obs] + out["loss_masks"][i]
                rows[-1]["lp"] = rows[-1]["lp"] + [0.0 for _ in obs] + out["rollout_logprobs"][i]
                rows[-1]["reward"] = out["rewards"][i]
                continue
        rows.append(dict(tid=out["trajectory_ids"][i], prompt=prompt, response=response, mask=out["loss_masks"][i],
                         lp=out["rollout_logprobs"][i], reward=out["rewards"][i]))
    return rows


@st.composite
def trajectories(draw):
    """Random multi-turn trajectories; each next prompt usually extends the history (sometimes corrupted)."""
    tokens = st.lists(st.integers(1, 9), min_size=1, max_size=4)
    rows = []
    for t in range(draw(st.integers(1, 4))):
        history = draw(tokens)
        for _ in range(draw(st.integers(1, 4))):
            prompt = list(history)
            if rows and rows[-1][5] == t and draw(st.integers(0, 4)) == 0:
                prompt[draw(st.integers(0, len(prompt) - 1))] = 0  # corrupted history: no merge
            response = draw(tokens)
            mask = draw(st.lists(st.integers(0, 1), min_size=len(response), max_size=len(response)))
            lp = [float(-k - 1) for k in range(len(response))]
            rows.append((prompt, response, mask, lp, float(t), t))
            history = prompt + response + draw(st.lists(st.integers(1, 9), max_size=3))
    tids = [r[5] for r in rows]
    return steps(*[r[:5] for r in rows], trajectory_ids=tids, uids=[f"u{t}" for t in tids])


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_matches_loop_reference_and_keeps_loss_tokens(out):
    original = copy.deepcopy(out)
    merged, counts = merge_stepwise_output(out)
    assert out == original  # the input is not modified
    validate_generator_output(merged, step_wise=True)
    expected = reference_merge(out)
    assert counts == {"num_seq_before_merge": len(out["uids"]), "num_seq_after_merge": len(expected)}
    assert merged["response_ids"] == [r["response"] for r in expected]
    assert merged["loss_masks"] == [r["mask"] for r in expected]
    assert merged["rollout_logprobs"] == [r["lp"] for r in expected]
    assert merged["rewards"] == [r["reward"] for r in expected]
    assert merged["trajectory_ids"] == [r["tid"] for r in expected]
    # every loss-masked token and its logprob survives, in order, within its own trajectory
    for tid in set(out["trajectory_ids"]):
        def trained(o):
            return [
                (tok, lp)
                for i in range(len(o["uids"])) if o["trajectory_ids"][i] == tid
                for tok, m, lp in zip(o["response_ids"][i], o["loss_masks"][i], o["rollout_logprobs"][i]) if m
            ]
        assert trained(merged) == trained(out)
        assert {u for u, t in zip(merged["uids"], merged["trajectory_ids"]) if t == tid} == {f"u{tid}"}
