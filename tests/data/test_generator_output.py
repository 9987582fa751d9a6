"""validate_generator_output: valid inputs pass; each rule fails with a ValueError naming field and index."""

import copy

import pytest

from megatron_rl.data import validate_generator_output


def step_wise_output() -> dict:
    """Two trajectories: ("p0", 0) with two steps, ("p0", 1) with one step."""
    return {
        "prompt_token_ids": [[1, 2], [1, 2, 3, 4], [1, 2]],
        "response_ids": [[3], [5, 6], [7]],
        "rewards": [0.0, 1.0, [0.0]],
        "loss_masks": [[1], [1, 0], [1]],
        "rollout_logprobs": [[-0.1], [-0.2, -0.3], [-0.4]],
        "uids": ["p0", "p0", "p0"],
        "trajectory_ids": [("p0", 0), ("p0", 0), ("p0", 1)],
        "is_last_step": [False, True, True],
        "stop_reasons": ["stop", "stop", "length"],
    }


def test_valid_outputs_pass():
    out = step_wise_output()
    validate_generator_output(out, step_wise=True)
    validate_generator_output(out, step_wise=False)
    minimal = {k: out[k] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "uids")}
    validate_generator_output(minimal, step_wise=False)
    validate_generator_output({**minimal, "rollout_logprobs": None}, step_wise=False)


def _set(path, value):
    def change(out):
        if len(path) == 1:
            out[path[0]] = value
        else:
            out[path[0]][path[1]] = value

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_set(["uids"], ["p0", "p0"]), r"\['uids'\] has 2 entries"),
        (_set(["stop_reasons"], ["stop"]), r"\['stop_reasons'\] has 1 entries"),
        (lambda out: out.pop("loss_masks"), "missing field 'loss_masks'"),
        (_set(["prompt_token_ids", 2], []), r"\['prompt_token_ids'\]\[2\] is empty"),
        (_set(["response_ids", 0], []), r"\['response_ids'\]\[0\] is empty"),
        (_set(["loss_masks", 1], [1]), r"\['loss_masks'\]\[1\] has length 1 but response_ids\[1\] has length 2"),
        (_set(["rollout_logprobs", 2], [-0.1, -0.2]), r"\['rollout_logprobs'\]\[2\] has length 2"),
        (_set(["rewards", 1], [1.0]), r"\['rewards'\]\[1\] has length 1"),
        (_set(["rewards", 1], None), r"\['rewards'\]\[1\] is a NoneType"),
    ],
)
def test_rules_for_every_mode(change, match):
    for step_wise in (False, True):
        out = copy.deepcopy(step_wise_output())
        change(out)
        with pytest.raises(ValueError, match=match):
            validate_generator_output(out, step_wise=step_wise)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda out: out.pop("trajectory_ids"), "missing field 'trajectory_ids'"),
        (_set(["is_last_step"], None), "missing field 'is_last_step'"),
        (
            lambda out: out.update(trajectory_ids=["a", "b", "a"], is_last_step=[True, True, True]),
            r"\['trajectory_ids'\]\[2\] = 'a' reappears",
        ),
        (_set(["trajectory_ids"], [["a"], ["a"], ["b"]]), r"\['trajectory_ids'\]\[0\] = \['a'\] is not hashable"),
        (_set(["is_last_step"], [True, True, True]), r"\['is_last_step'\]\[0\] is True but should be False"),
        (_set(["is_last_step"], [False, False, True]), r"\['is_last_step'\]\[1\] is False but should be True"),
        (_set(["is_last_step"], [False, True, False]), r"\['is_last_step'\]\[2\] .*the final entry"),
        (_set(["uids"], ["p0", "p1", "p1"]), r"\['uids'\]\[1\] = 'p1' differs from uids\[0\]"),
    ],
)
def test_step_wise_rules(change, match):
    out = copy.deepcopy(step_wise_output())
    change(out)
    with pytest.raises(ValueError, match=match):
        validate_generator_output(out, step_wise=True)
    if "missing" not in match:
        validate_generator_output(out, step_wise=False)  # step-wise rules only apply step-wise


# ---------------------------------------------------------------------- values (checked on the converted blocks)


@pytest.mark.parametrize(
    "field, index, value, needle",
    [
        ("loss_masks", 1, [1, 2], r"GeneratorOutput\['loss_masks'\]\[1\] holds values other than 0 and 1"),
        ("loss_masks", 0, [0.5], r"GeneratorOutput\['loss_masks'\]\[0\] holds values other than 0 and 1"),
        ("rewards", 2, float("nan"), r"rewards\[2\] holds a NaN"),
        ("rewards", 0, [float("inf")], r"rewards\[0\] holds a NaN or infinite"),
        ("rollout_logprobs", 1, [-0.2, float("nan")], r"logprobs\[1\] holds a NaN"),
        ("response_ids", 0, [3.7], "token ids must be integers"),
        ("prompt_token_ids", 2, [1.0, 2.0], "token ids must be integers"),
    ],
)
def test_bad_values_rejected_at_conversion(field, index, value, needle):
    from megatron_rl.data import TrainingBatch

    out = step_wise_output()
    out[field][index] = value
    if field == "rewards" or field == "rollout_logprobs":
        out["is_last_step"], out["trajectory_ids"] = [True] * 3, [0, 1, 2]  # values, not step-wise rules
    with pytest.raises(ValueError, match=needle):
        TrainingBatch.from_generator_output(out, pad_token_id=0)


def test_reward_on_a_non_last_step_warns():
    out = step_wise_output()
    out["rewards"][0] = 0.5
    with pytest.warns(UserWarning, match=r"rewards'\]\[0\] is non-zero on a step that is not"):
        validate_generator_output(out, step_wise=True)


def test_without_step_wise_every_sequence_is_its_own_trajectory():
    from megatron_rl.data import TrainingBatch

    out = step_wise_output()
    out["is_last_step"] = [False, False, False]
    batch = TrainingBatch.from_generator_output(out, pad_token_id=0, step_wise=False)
    assert batch.is_last_step == [True, True, True] and batch.trajectory_ids == [0, 1, 2]


# ---------------------------------------------------------------------- library inputs: types, keys, values


def _plain_output() -> dict:
    out = step_wise_output()
    out["is_last_step"], out["trajectory_ids"] = [True] * 3, [0, 1, 2]
    return out


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda out: ["not", "a", "mapping"], "must be a mapping"),
        (lambda out: {**out, "advantages": [[0.0]] * 3}, r"unknown key\(s\) \['advantages'\].*optional"),
        (_set(["prompt_token_ids", 1], None), r"\['prompt_token_ids'\]\[1\] is a NoneType"),
        (_set(["loss_masks", 0], None), r"\['loss_masks'\]\[0\] is a NoneType"),
        (_set(["uids"], 7), r"\['uids'\] is a int"),
        (_set(["uids", 1], ["unhashable"]), r"\['uids'\]\[1\] = \['unhashable'\] is not hashable"),
        (_set(["rollout_logprobs", 1], [-0.2, 0.5]), r"\['rollout_logprobs'\]\[1\]\[1\] = .* is above 0"),
        (_set(["rewards", 1], "high"), r"\['rewards'\]\[1\] is a str"),
        (_set(["rewards", 2], [None]), r"\['rewards'\]\[2\] holds a NoneType"),
    ],
)
def test_malformed_library_inputs_name_the_field(change, needle):
    out = copy.deepcopy(_plain_output())
    out = change(out) or out  # _set mutates in place; the lambdas return a new object
    with pytest.raises(ValueError, match=needle):
        validate_generator_output(out, step_wise=False)


def test_nan_reward_on_a_non_last_step_is_rejected():
    out = step_wise_output()
    out["rewards"][0] = float("nan")  # its step's reward is unused, but a NaN means a broken reward function
    with pytest.raises(ValueError, match=r"rewards\[0\] holds a NaN"):
        validate_generator_output(out, step_wise=True)


def test_tensors_and_arrays_are_accepted_as_plain_values():
    import numpy as np
    import torch

    out = _plain_output()
    expected = validate_generator_output(copy.deepcopy(out), step_wise=False)
    assert expected == out  # plain input comes back unchanged
    out["rewards"] = [torch.tensor(0.0, requires_grad=True), np.float32(1.0), torch.zeros(1, requires_grad=True)]
    out["rollout_logprobs"][1] = torch.tensor([-0.2, -0.3], requires_grad=True)
    out["response_ids"] = [np.array([3]), torch.tensor([5, 6]), [7]]
    out["uids"] = torch.tensor([0, 0, 0])
    plain = validate_generator_output(out, step_wise=False)
    assert plain is not out and isinstance(out["uids"], torch.Tensor)  # the caller's dict is not modified
    assert plain["rewards"] == [0.0, 1.0, [0.0]] and plain["response_ids"] == [[3], [5, 6], [7]]
    assert plain["uids"] == [0, 0, 0] and all(isinstance(v, float) for v in plain["rollout_logprobs"][1])
    assert plain["rollout_logprobs"][1] == [torch.tensor(-0.2).item(), torch.tensor(-0.3).item()]
