"""TrainingBatch: construction from rollouts, slicing, concat of different widths, DP padding."""

import pytest
import torch
from tests.support.data_strategies import reference_convert, rollouts
from hypothesis import given, settings

from megatron_rl.data import TrainingBatch, pack


def make_batch(out: dict, pad_token_id: int = 0) -> TrainingBatch:
    return TrainingBatch.from_generator_output(out, pad_token_id)


def reference_left_pad(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    out = torch.full((t.shape[0], width), fill, dtype=t.dtype)
    for i in range(t.shape[0]):
        out[i, width - t.shape[1] :] = t[i]
    return out


@settings(max_examples=25, deadline=None)
@given(rollouts(), rollouts())
def test_from_generator_output_and_concat_match_references(out_a, out_b):
    a, b = make_batch(out_a, pad_token_id=9), make_batch(out_b, pad_token_id=9)
    args = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs")
    expected_a = reference_convert(9, *(out_a[k] for k in args))
    keys = ("sequences", "attention_mask", "response_mask", "rewards", "loss_mask", "rollout_logprobs")
    for key, e in zip(keys, expected_a):
        assert torch.equal(a[key], e)
    assert a.trajectory_ids == list(range(len(a))) and a.is_last_step == [True] * len(a)

    both = TrainingBatch.concat([a, b], pad_token_id=9)
    assert len(both) == len(a) + len(b)
    assert both.uids == a.uids + b.uids
    for key in keys:
        width = max(a[key].shape[1], b[key].shape[1])
        fill = 9 if key == "sequences" else 0
        expected = torch.cat([reference_left_pad(a[key], width, fill), reference_left_pad(b[key], width, fill)])
        assert torch.equal(both[key], expected), key
    assert torch.equal(both.slice(len(a), len(both))["sequences"][:, -b["sequences"].shape[1] :], b["sequences"])


def small_batch(num_rows: int) -> TrainingBatch:
    out = {
        "prompt_token_ids": [[1, 2]] * num_rows,
        "response_ids": [[3, 4, 5]] * num_rows,
        "rewards": [1.0] * num_rows,
        "loss_masks": [[1, 1, 0]] * num_rows,
        "uids": [f"u{i}" for i in range(num_rows)],
    }
    batch = make_batch(out)
    batch["advantages"] = torch.ones(num_rows, 3)
    batch["scores"] = torch.arange(num_rows, dtype=torch.float32)  # a [B] tensor
    return batch


@pytest.mark.parametrize("num_rows, k, num_pad", [(1, 8, 7), (3, 2, 1), (4, 4, 0), (5, 1, 0), (2, 3, 1)])
def test_pad_to_multiple(num_rows, k, num_pad):
    batch = small_batch(num_rows)
    padded, got_pad = batch.pad_to_multiple(k, pad_token_id=0)
    assert got_pad == num_pad and len(padded) == num_rows + num_pad and len(padded) % k == 0
    for key in batch.keys():
        assert torch.equal(padded[key][:num_rows], batch[key])
        dummy = padded[key][num_rows:]
        assert dummy.shape == (num_pad, *batch[key].shape[1:])
        if key == "attention_mask":
            assert torch.equal(dummy, torch.tensor([[0, 0, 0, 0, 1]] * num_pad, dtype=dummy.dtype).reshape(dummy.shape))
        else:
            assert torch.all(dummy == 0)  # pad_token_id 0 for sequences; zero masks/advantages/rewards
    assert padded.uids[num_rows:] == [None] * num_pad
    assert padded.trajectory_ids[num_rows:] == [None] * num_pad
    assert padded.is_last_step[num_rows:] == [True] * num_pad
    packed = pack(padded["sequences"], padded["attention_mask"])  # dummy rows are valid minimal sequences
    assert packed.seq_lens.tolist() == [5] * num_rows + [1] * num_pad


def test_dummy_sequence_uses_pad_token():
    padded, _ = small_batch(1).pad_to_multiple(2, pad_token_id=42)
    assert padded["sequences"][1].tolist() == [42] * 5


def test_slice_set_contains_to():
    batch = small_batch(4)
    part = batch.slice(1, 3)
    assert part.uids == ["u1", "u2"] and torch.equal(part["scores"], torch.tensor([1.0, 2.0]))
    assert "advantages" in batch and "values" not in batch
    moved = batch.to("cpu")
    assert torch.equal(moved["sequences"], batch["sequences"])


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda b: b.__setitem__("values", torch.zeros(3, 3)), r"TrainingBatch\['values'\] has shape \(3, 3\)"),
        (lambda b: b.pad_to_multiple(0, 0), "k=0 must be >= 1"),
        (lambda b: TrainingBatch.concat([]), "empty list"),
        (lambda b: TrainingBatch.concat([b, small_batch(1)]), "batch 1 has keys"),
        (lambda b: TrainingBatch(b.tensors, b.uids, b.trajectory_ids[:1], b.is_last_step), "trajectory_ids has 1"),
    ],
)
def test_bad_use_names_the_problem(action, match):
    batch = small_batch(2)
    if "batch 1 has keys" in match:
        batch["extra"] = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        action(batch)
