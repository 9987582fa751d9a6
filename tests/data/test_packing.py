"""THD packing: exact small pack, loop references for pack/unpack, alignment, target length, autograd."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import (
    convert_prompts_responses_to_batch_tensors,
    pack,
    packing_alignment,
    pad_packed_to,
    unpack_response,
)


def test_exact_small_pack_align_4():
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 8], [0, 0, 0, 0, 9]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    p = pack(input_ids, attention_mask, align=4)
    assert torch.equal(p.input_ids, torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4, 8, 0, 0, 0, 9, 0, 0, 0]]))
    assert torch.equal(p.position_ids, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]))
    assert torch.equal(p.labels, torch.tensor([[6, 7, 0, 0, 2, 3, 4, 8, 0, 0, 0, 0, 0, 0, 0, 0]]))
    assert torch.equal(p.label_mask, torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]))
    assert torch.equal(p.cu_seqlens, torch.tensor([0, 4, 12, 16], dtype=torch.int32))
    assert p.seq_lens.tolist() == [3, 5, 1] and p.max_seqlen == 8
    # R = 2: row 0 -> predictions of tokens 6, 7 (positions 0, 1); row 2 has one token -> zeros
    values = torch.arange(16.0) + 100
    assert torch.equal(unpack_response(values[None], p, 2), torch.tensor([[100.0, 101], [106, 107], [0, 0]]))


def reference_pack(input_ids, attention_mask, align):
    ids, pos, labels, label_mask, cu = [], [], [], [], [0]
    for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        valid = [t for t, m in zip(row, mask) if m]
        padded = -(-len(valid) // align) * align
        ids += valid + [0] * (padded - len(valid))
        pos += list(range(padded))
        labels += valid[1:] + [0] * (padded - len(valid) + 1)
        label_mask += [1] * (len(valid) - 1) + [0] * (padded - len(valid) + 1)
        cu.append(cu[-1] + padded)
    return ids, pos, labels, label_mask, cu


def reference_unpack(values, attention_mask, cu, width):
    out = torch.zeros(attention_mask.shape[0], width)
    for i, n in enumerate(attention_mask.sum(1).tolist()):
        for j in range(n - 1):  # position j predicts valid token j + 1
            k = j - (n - width - 1)
            if 0 <= k < width:
                out[i, k] = values[cu[i] + j]
    return out


@st.composite
def left_padded_rows(draw):
    num_rows = draw(st.integers(1, 5))
    width = draw(st.integers(1, 12))
    lens = draw(st.lists(st.integers(1, width), min_size=num_rows, max_size=num_rows))
    if draw(st.booleans()):
        lens[draw(st.integers(0, num_rows - 1))] = 1  # a row with one valid token
    ids = torch.tensor(draw(st.lists(st.integers(1, 99), min_size=num_rows * width, max_size=num_rows * width)))
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lens)[:, None]).long()
    return ids.reshape(num_rows, width) * mask, mask, draw(st.integers(1, width))


@settings(max_examples=40, deadline=None)
@given(left_padded_rows(), st.sampled_from([1, 2, 8]))
def test_pack_unpack_match_loop_reference(rows, align):
    input_ids, attention_mask, width = rows
    p = pack(input_ids, attention_mask, align)
    ids, pos, labels, label_mask, cu = reference_pack(input_ids, attention_mask, align)
    assert p.input_ids.tolist() == [ids] and p.position_ids.tolist() == [pos]
    assert p.labels.tolist() == [labels] and p.label_mask.tolist() == [label_mask]
    assert p.cu_seqlens.tolist() == cu and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    values = torch.randn(p.total_len)
    assert torch.equal(unpack_response(values, p, width), reference_unpack(values, attention_mask, cu, width))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=5), st.sampled_from([1, 2, 8]))
def test_unpacked_labels_are_the_response_tokens(lengths, align):
    """Batch layout + packing agree: the label predicted at response column k is sequences[:, -R:][k]."""
    prompts = [list(range(10, 10 + p)) for p, _ in lengths]
    responses = [list(range(50, 50 + r)) for _, r in lengths]
    seqs, attn, resp_mask, *_ = convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, [0.0] * len(lengths), [[1] * r for _, r in lengths]
    )
    width = resp_mask.shape[1]
    p = pack(seqs, attn, align)
    got = unpack_response(p.labels, p, width)
    assert torch.equal(got * resp_mask, seqs[:, -width:] * resp_mask)
    assert torch.equal(unpack_response(p.label_mask, p, width) * resp_mask, resp_mask)


def test_pad_packed_to_adds_a_dummy_sequence():
    input_ids = torch.tensor([[0, 3, 4], [5, 6, 7]])
    attention_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    p = pack(input_ids, attention_mask, align=2)
    padded = pack(input_ids, attention_mask, align=2, target_len=12)
    assert torch.equal(pad_packed_to(p, 12).input_ids, padded.input_ids)
    assert padded.cu_seqlens.tolist() == [0, 2, 6, 12] and padded.seq_lens.tolist() == [2, 3]
    assert padded.position_ids[0, 6:].tolist() == list(range(6))
    assert padded.label_mask[0, 6:].sum() == 0 and padded.max_seqlen == 6
    values = torch.randn(12)
    assert torch.equal(unpack_response(values, padded, 2), unpack_response(values[:6], p, 2))
    assert pad_packed_to(p, p.total_len) is p
    with pytest.raises(ValueError, match="total_len=4 is shorter"):
        pad_packed_to(p, 4)


def test_unpack_is_differentiable():
    p = pack(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 1, 1]]), align=1)
    values = torch.randn(1, p.total_len, requires_grad=True)
    unpack_response(values, p, 2).sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize(
    "tp, cp, sp, expected", [(1, 1, False, 1), (4, 1, False, 1), (4, 1, True, 4), (2, 2, True, 8), (1, 2, False, 4)]
)
def test_packing_alignment(tp, cp, sp, expected):
    assert packing_alignment(tp, cp, sp) == expected


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: packing_alignment(0, 1, False), "tp_size=0"),
        (lambda: pack(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), align=0), "align=0"),
        (lambda: pack(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)), "must both be"),
        (lambda: pack(torch.ones(2, 2, dtype=torch.long), torch.tensor([[1, 1], [0, 0]])), "row 1 has no valid"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_packed_seq_params():
    pytest.importorskip("megatron.core")
    p = pack(torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), align=2)
    params = p.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 2, 6]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 4  # longest sequence, not the pack (6)


# ---------------------------------------------------------------------- context parallelism: split_for_cp


def test_split_for_cp_exact_small_pack():
    """cp=2: sequences of 4 and 8 tokens -> chunks of 1 and 2; rank r holds chunks r and 3-r of each."""
    from megatron_rl.data.packing import cp_token_index, split_for_cp

    p = pack(torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 8]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), 4)
    assert cp_token_index(p.cu_seqlens, 2).tolist() == [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    local = split_for_cp(p, 2, 1)
    assert local.input_ids.tolist() == [[6, 7, 3, 4, 8, 0]]
    assert local.position_ids.tolist() == [[1, 2, 2, 3, 4, 5]]  # global positions within each sequence
    assert local.labels.tolist() == [[7, 0, 4, 8, 0, 0]] and local.label_mask.tolist() == [[1, 0, 1, 1, 0, 0]]
    assert local.cu_seqlens is p.cu_seqlens and local.max_seqlen == p.max_seqlen and local.total_len == 6
    params = local.packed_seq_params()  # TE's CP attention reads the padded cu_seqlens
    assert params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded is p.cu_seqlens


@settings(max_examples=30, deadline=None)
@given(left_padded_rows(), st.sampled_from([2, 4]), st.sampled_from([1, 2]))
def test_split_for_cp_partitions_the_pack(rows, cp, tp):
    """The CP ranks' local packs hold every token exactly once, each rank the same count, in the chunk layout
    (each sequence's chunk r then chunk 2cp-1-r), with labels and positions of the whole pack."""
    from megatron_rl.data.packing import split_for_cp

    input_ids, attention_mask, _ = rows
    p = pack(input_ids, attention_mask, packing_alignment(tp, cp, False))
    locals_ = [split_for_cp(p, cp, r) for r in range(cp)]
    seen = torch.cat([loc.cp_index[r] for r, loc in enumerate(locals_)])
    assert sorted(seen.tolist()) == list(range(p.total_len))
    bounds = p.cu_seqlens.tolist()
    for r, loc in enumerate(locals_):
        expected = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            c = (e - s) // (2 * cp)
            mirror = 2 * cp - 1 - r
            expected += list(range(s + r * c, s + (r + 1) * c)) + list(range(s + mirror * c, s + (mirror + 1) * c))
        assert loc.cp_index[r].tolist() == expected
        for name in ("input_ids", "position_ids", "labels", "label_mask"):
            assert torch.equal(getattr(loc, name)[0], getattr(p, name)[0, expected]), name


def test_split_for_cp_bad_input():
    from megatron_rl.data.packing import cp_token_index, split_for_cp

    p = pack(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]]), align=3)
    with pytest.raises(ValueError, match="not a multiple of 2\\*context_parallel_size=4"):
        split_for_cp(p, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        split_for_cp(p, 2, 2)
    with pytest.raises(ValueError, match="cp_size=0"):
        cp_token_index(p.cu_seqlens, 0)
