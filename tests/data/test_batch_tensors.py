"""convert_prompts_responses_to_batch_tensors and response_values: exact layouts, loop references, bad input."""

import warnings

import pytest
import torch
from tests.support.data_strategies import reference_convert, rollouts
from hypothesis import given, settings

from megatron_rl.data import convert_prompts_responses_to_batch_tensors, response_values

PROMPTS = [[11, 12, 13, 14], [21], [31, 32]]
RESPONSES = [[15], [22, 23, 24, 25], [33]]  # anti-correlated with the prompts
REWARDS = [1.0, [0.1, 0.2, 0.3, 0.4], -1.0]
LOSS_MASKS = [[1], [1, 0, 0, 1], [0]]
LOGPROBS = [[-0.5], [-1.0, -2.0, -3.0, -4.0], [-0.25]]


def test_exact_layout_anti_correlated_lengths():
    seqs, attn, resp_mask, rewards, loss_mask, logprobs = convert_prompts_responses_to_batch_tensors(
        0, PROMPTS, RESPONSES, REWARDS, LOSS_MASKS, LOGPROBS
    )
    # S = max(p + r) = 5, not max(p) + max(r) = 8; R = 4.
    assert torch.equal(seqs, torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [0, 0, 31, 32, 33]]))
    assert torch.equal(attn, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]))
    assert torch.equal(resp_mask, torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1]]))
    expected_rewards = torch.tensor([[0, 0, 0, 1.0], [0.1, 0.2, 0.3, 0.4], [0, 0, 0, -1.0]], dtype=torch.float32)
    assert torch.equal(rewards, expected_rewards)
    assert torch.equal(loss_mask, torch.tensor([[0, 0, 0, 1.0], [1, 0, 0, 1], [0, 0, 0, 0]]))
    assert torch.equal(logprobs, torch.tensor([[0, 0, 0, -0.5], [-1, -2, -3, -4], [0, 0, 0, -0.25]]))
    assert seqs.dtype == attn.dtype == resp_mask.dtype == torch.int64
    assert rewards.dtype == loss_mask.dtype == logprobs.dtype == torch.float32


def test_without_logprobs_and_pad_token():
    seqs, attn, _, _, _, logprobs = convert_prompts_responses_to_batch_tensors(
        7, [[1, 2, 3], [4]], [[5], [6]], [0.0, 1.0], [[1], [1]]
    )
    assert logprobs is None
    assert torch.equal(seqs, torch.tensor([[1, 2, 3, 5], [7, 7, 4, 6]]))
    assert torch.equal(attn, torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))


def test_max_seq_len_warns_and_keeps_every_token():
    with pytest.warns(UserWarning, match="max_seq_len=4"):
        seqs, *_ = convert_prompts_responses_to_batch_tensors(0, PROMPTS, RESPONSES, REWARDS, LOSS_MASKS, max_seq_len=4)
    assert seqs.shape == (3, 5)
    assert torch.equal(seqs[0], torch.tensor([11, 12, 13, 14, 15]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_prompts_responses_to_batch_tensors(0, PROMPTS, RESPONSES, REWARDS, LOSS_MASKS, max_seq_len=5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(responses=[[15], [], [33]]), r"responses\[1\] is empty"),
        (dict(prompts=[[11], [21], []]), r"prompts\[2\] is empty"),
        (dict(loss_masks=[[1], [1, 0, 1], [0]]), r"loss_masks\[1\] has length 3"),
        (dict(rewards=[1.0, [0.1], -1.0]), r"rewards\[1\] has length 1"),
        (dict(logprobs=[[-0.5], [-1.0] * 4, [-0.25, 0.0]]), r"logprobs\[2\] has length 2"),
        (dict(rewards=[1.0, 2.0]), r"rewards has 2 rows but prompts has 3"),
        (dict(prompts=[], responses=[], rewards=[], loss_masks=[], logprobs=None), "prompts is empty"),
    ],
)
def test_bad_input_names_the_field(change, match):
    args = dict(prompts=PROMPTS, responses=RESPONSES, rewards=REWARDS, loss_masks=LOSS_MASKS, logprobs=LOGPROBS)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        convert_prompts_responses_to_batch_tensors(0, **args)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("prompt_token_ids", [[11], [21], []], r"GeneratorOutput\['prompt_token_ids'\]\[2\] is empty"),
        ("rollout_logprobs", [[-0.5], [-1.0] * 4, [-0.25, 0.0]],
         r"GeneratorOutput\['rollout_logprobs'\]\[2\] has length 2 but GeneratorOutput\['response_ids'\]\[2\]"),
        ("rollout_logprobs", [[float("nan")], [-1.0] * 4, [-0.25]], r"GeneratorOutput\['rollout_logprobs'\]\[0\] holds a NaN"),
        ("rewards", [1.0, [0.1], -1.0], r"GeneratorOutput\['rewards'\]\[1\] has length 1"),
    ],
)
def test_generator_output_errors_use_its_public_keys(field, value, match):
    """Converting a ``GeneratorOutput`` (here with ``validated=True``: the Trainer's path after its own check)
    names its keys, never the converter's argument names (``prompts``, ``logprobs``)."""
    from megatron_rl.data.batch import TrainingBatch

    out = dict(prompt_token_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS, loss_masks=LOSS_MASKS,
               rollout_logprobs=LOGPROBS, uids=[0, 1, 2])
    out[field] = value
    with pytest.raises(ValueError, match=match):
        TrainingBatch.from_generator_output(out, 0, validated=True)


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_matches_loop_reference(out):
    args = (out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"], out["rollout_logprobs"])
    got = convert_prompts_responses_to_batch_tensors(0, *args)
    expected = reference_convert(0, *args)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    # every real token appears once, in order: the attended tokens of row i are prompt_i + response_i
    seqs, attn, resp_mask = got[:3]
    for i, (p, r) in enumerate(zip(out["prompt_token_ids"], out["response_ids"])):
        assert seqs[i][attn[i].bool()].tolist() == p + r
        assert seqs[i, -len(r):].tolist() == r  # responses end at column S-1
        assert resp_mask[i].sum() == len(r)


def test_response_values_takes_from_the_right():
    x = torch.arange(12.0).reshape(3, 4)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    got = response_values(x, mask)
    expected = [x[i, x.shape[1] - int(mask[i].sum()):] for i in range(3)]
    assert len(got) == 3
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert got[2].numel() == 0
