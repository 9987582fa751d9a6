"""The multi-rank harness itself: results in rank order, env set, child errors and hangs surface."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> dict:
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)
    env = {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    return {"rank": rank, "sum": value.item(), "env": env}


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank 1")
    time.sleep(60)  # rank 0 would wait forever in a collective; the harness must kill it
    return rank


def _hang(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_results_in_rank_order_and_env():
    out = run_ranks(2, _all_reduce_rank, 2.0)
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["sum"] == 2.0 for r in out)  # 0*2 + 1*2
    assert out[1]["env"] == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1"}


def test_child_traceback_and_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*KeyError: 'boom from rank 1'"):
        run_ranks(2, _fail_on_rank_1)
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(1, _hang, timeout=3)
    assert time.monotonic() - start < 30
