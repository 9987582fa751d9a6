"""initialize_distributed: argument checks before any collective, groups and seeding on 1 and 2 ranks."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ParallelConfig
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed, select_device
from megatron_rl.job.main import check_ranks_agree
from tests.support.multirank import run_ranks


def test_world_size_not_divisible_raises_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: any rendezvous attempt would hang or fail
    with pytest.raises(ValueError, match="world size 3 is not divisible"):
        initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=0)
    assert not dist.is_initialized()


def test_parallel_device_choices_and_errors(monkeypatch):
    """parallel.device: a bad value names the key; cuda without a GPU and more ranks than GPUs are ConfigErrors
    that say what to do (before any collective); cpu hides CUDA, or refuses once CUDA was queried."""
    with pytest.raises(ConfigError, match="parallel.device"):
        ParallelConfig(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="parallel.device='cuda' but no CUDA device is visible"):
            select_device(ParallelConfig(device="cuda"), 1, 0)
        assert select_device(ParallelConfig(), 1, 0) == torch.device("cpu")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test
        assert select_device(ParallelConfig(device="cpu"), 4, 0) == torch.device("cpu")
    else:  # this process has queried CUDA (conftest): too late to hide it
        with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES="):
            select_device(ParallelConfig(device="cpu"), 1, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"2 ranks on this node but 1 visible CUDA GPU\(s\).*NPROC=1.*"
                                          r"parallel.device=cpu"):
        select_device(ParallelConfig(), 2, 0)
    assert select_device(ParallelConfig(device="cuda"), 1, 0) == torch.device("cuda", 0)


def test_single_process_without_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    groups = initialize_distributed(ParallelConfig(), seed=3)
    try:
        assert (groups.world_size, groups.tp_size, groups.pp_size, groups.dp_size) == (1, 1, 1, 1)
        assert groups.is_first_stage and groups.is_last_stage
        assert groups.pg_collection.tp is groups.tp_group
        with pytest.raises(RuntimeError, match="already initialized"):
            initialize_distributed(ParallelConfig(), seed=3)
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


def _tp2_groups_and_rng(rank: int, world_size: int) -> dict:
    from megatron.core import tensor_parallel

    groups = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=7)
    default_draw = torch.rand(4)  # same seed on both TP ranks (one stage)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)  # model-parallel state: differs by tp_rank
    after = torch.rand(4)  # fork restored the default stream
    rank_sum = torch.tensor([float(rank)])
    dist.all_reduce(rank_sum, group=groups.tp_group)
    check_ranks_agree(groups, [[1, 2, 3], [0.5]])  # the same rollouts on both ranks: passes
    try:  # rank 1 sampled another token: both ranks learn it, the TP group named
        check_ranks_agree(groups, [[1, 2, 3 + rank], [0.5]])
        disagreement = None
    except RuntimeError as err:
        disagreement = str(err)
    return {
        "tp": (groups.tp_rank, groups.tp_size), "dp": groups.dp_size, "tp_sum": rank_sum.item(),
        "default": default_draw, "forked": forked, "after": after, "disagreement": disagreement,
    }


@pytest.mark.multirank
def test_tp2_groups_and_model_parallel_rng():
    out = run_ranks(2, _tp2_groups_and_rng)
    assert [o["tp"] for o in out] == [(0, 2), (1, 2)]
    assert all(o["dp"] == 1 and o["tp_sum"] == 1.0 for o in out)
    torch.manual_seed(7)
    expected_default = torch.rand(4)
    expected_after = torch.rand(4)
    for o in out:
        torch.testing.assert_close(o["default"], expected_default, rtol=0, atol=0)
        torch.testing.assert_close(o["after"], expected_after, rtol=0, atol=0)
    assert not torch.equal(out[0]["forked"], out[1]["forked"])
    # job/main.py check_ranks_agree: one world-level check, the group named only on a mismatch
    assert all(o["disagreement"] and o["disagreement"].startswith("ranks of the tp_group sampled different") for o in out)
