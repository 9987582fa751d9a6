"""bench_gpu: exits 0 without CUDA; its pure helpers (FLOPs, peak table, padded micro-batches)."""

import pytest
import torch

import bench_gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_says_so_and_exits_zero(capsys):
    assert bench_gpu.main(["--small"]) == 0
    assert "needs CUDA" in capsys.readouterr().out


def test_peak_table_and_flops():
    assert bench_gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert bench_gpu.peak_flops("NVIDIA H200") == 989e12
    assert bench_gpu.peak_flops("Tesla T4") is None
    shape = bench_gpu.SHAPES["small"]
    one = bench_gpu.model_flops(shape, [10], train=False)
    assert bench_gpu.model_flops(shape, [10], train=True) == 3 * one
    # attention grows quadratically: two sequences of 10 cost less than one of 20
    assert bench_gpu.model_flops(shape, [10, 10], False) < bench_gpu.model_flops(shape, [20], False)


def test_padded_micro_batches_respect_the_budget_and_cover_every_row():
    lens = [5, 9, 3, 7, 2, 8]
    mask = torch.zeros(len(lens), 10, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, 10 - n:] = 1
    batches = bench_gpu.padded_micro_batches(mask, 16)
    assert [s for s, _, _ in batches][0] == 0 and batches[-1][1] == len(lens)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(batches, batches[1:]))
    for start, end, width in batches:
        assert width == max(lens[start:end])
        assert end - start == 1 or (end - start) * width <= 16


def test_workload_is_anti_correlated():
    out = bench_gpu.workload(32, small=True)
    prompts = torch.tensor([len(p) for p in out["prompt_token_ids"]], dtype=torch.float)
    responses = torch.tensor([len(r) for r in out["response_ids"]], dtype=torch.float)
    assert torch.corrcoef(torch.stack([prompts, responses]))[0, 1] < -0.5
