"""Exact resume and cross-layout loading of distributed checkpoints (2 gloo ranks, one spawn).

The spawn visits four layouts in turn (re-initializing megatron's parallel state in between):

  A  TP2, distributed optimizer: 4 uninterrupted steps with a checkpoint after step 2, then a fresh policy
     resumed from it runs steps 3-4 again. Reference: the uninterrupted run (bitwise).
  B  DP2, local (FP32) optimizer: the same.
  E  DP2, local SGD with momentum: the same.
  C  DP2 (TP1), distributed optimizer: loads A's TP2 checkpoint. Reference: A's step-2 weights (bitwise) and
     A's steps 3-4 (same math in another layout: float tolerance). A local optimizer is refused (ValueError),
     weights-only loading works.
  D  PP2, distributed optimizer: loads A's TP2 checkpoint, as C.

LR warmup + linear decay make the scheduler state matter; Adam moments make the optimizer state matter (a
resume without them moves the weights by O(lr) = 1e-2, far outside the tolerances). The same holds for SGD's
momentum buffers.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.ckpt_helpers import full_weights, make_batch, make_config, train_step
from tests.support.multirank import run_ranks
from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

STEPS, SAVE_AT = 4, 2


def _draw_rng() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def _policy(config):
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    groups = initialize_distributed(config.parallel, seed=config.seed)
    return MegatronPolicy(config, groups), groups


def _resume_run(config, save_dir: Path) -> dict:
    """Uninterrupted run with a save after SAVE_AT, then a fresh policy resumed from that save."""
    from megatron_rl.model.policy import MegatronPolicy

    policy, groups = _policy(config)
    batch = make_batch()
    steps, out = [], {}
    for k in range(1, STEPS + 1):
        steps.append(train_step(policy, batch))
        if k == SAVE_AT:
            save_checkpoint(policy, str(save_dir), {"step": k, "consumed_prompts": 4 * k})
            out["weights_at_save"] = full_weights(policy)
            out["rng_at_save"] = _draw_rng()
    out["steps"], out["final"] = steps[SAVE_AT:], full_weights(policy)
    resumed = MegatronPolicy(config, groups)
    torch.manual_seed(12345)  # disturb the generators: the checkpoint must restore them
    out["trainer_state"] = load_checkpoint(resumed, str(save_dir))
    out["rng_after_load"] = _draw_rng()
    out["resumed_steps"] = [train_step(resumed, batch) for _ in range(STEPS - SAVE_AT)]
    out["resumed_final"] = full_weights(resumed)
    return out


def _reshard_run(config, source: Path) -> dict:
    """Load a checkpoint saved under another layout; continue training from it."""
    from megatron_rl.model.policy import MegatronPolicy

    policy, groups = _policy(config)
    batch = make_batch()
    out = {"trainer_state": load_checkpoint(policy, str(source)), "loaded": full_weights(policy)}
    out["steps"] = [train_step(policy, batch) for _ in range(STEPS - SAVE_AT)]
    out["final"] = full_weights(policy)
    local = MegatronPolicy(make_config(config.parallel.tensor_model_parallel_size,
                                       config.parallel.pipeline_model_parallel_size), groups)
    try:
        load_checkpoint(local, str(source))
        out["kind_error"] = None
    except ValueError as err:
        out["kind_error"] = str(err)
    load_checkpoint(local, str(source), load_optimizer=False)
    out["weights_only"] = full_weights(local)
    return out


def _rank0_filesystem_failure(config, save_dir: Path) -> str:
    """Rank 0 alone cannot create the checkpoint directory (a regular file is in the way): every rank must
    raise, and the ranks must still meet in the next collective (no rank left waiting)."""
    import torch.distributed as dist

    policy, _ = _policy(config)
    if dist.get_rank() == 0:
        save_dir.write_text("a file where the checkpoint directory should be")
    dist.barrier()
    try:
        save_checkpoint(policy, str(save_dir), {"step": 1})
        outcome = "no error"
    except (OSError, RuntimeError) as err:
        outcome = type(err).__name__
    dist.barrier()
    return outcome


def _layouts_child(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    out = {
        "A": _resume_run(make_config(tp=2, distributed=True), root / "A"),
        "B": _resume_run(make_config(distributed=False), root / "B"),
        "C": _reshard_run(make_config(distributed=True), root / "A"),
        "D": _reshard_run(make_config(pp=2, distributed=True), root / "A"),
        "E": _resume_run(make_config(optimizer="sgd"), root / "E"),
        "rank0_failure": _rank0_filesystem_failure(make_config(), root / "not_a_dir"),
    }
    return out if rank == 0 else {"rank0_failure": out["rank0_failure"]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(2, _layouts_child, str(tmp_path_factory.mktemp("ckpt_layouts")), timeout=600)


@pytest.fixture(scope="module")
def layouts(ranks):
    return ranks[0]


@pytest.mark.slow  # the ranks fixture spawns 2 ranks
def test_a_rank0_filesystem_error_raises_on_every_rank(ranks):
    assert [r["rank0_failure"] for r in ranks] == ["FileExistsError", "RuntimeError"]


def _assert_equal_weights(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for name in a:
        assert torch.equal(a[name], b[name]), (what, name, (a[name] - b[name]).abs().max().item())


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["A", "B", "E"])
def test_resume_is_bitwise(layouts, case):
    run = layouts[case]
    assert run["trainer_state"] == {"step": SAVE_AT, "consumed_prompts": 4 * SAVE_AT}
    assert run["resumed_steps"] == run["steps"]  # losses, grad norms, learning rates: exact floats
    assert run["steps"][0]["lr"] != run["steps"][1]["lr"]  # the schedule moves: its state matters
    _assert_equal_weights(run["resumed_final"], run["final"], case)
    assert run["rng_after_load"] == run["rng_at_save"]


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["C", "D"])
def test_load_under_another_layout(layouts, case):
    source, run = layouts["A"], layouts[case]
    assert run["trainer_state"]["step"] == SAVE_AT
    _assert_equal_weights(run["loaded"], source["weights_at_save"], case)
    _assert_equal_weights(run["weights_only"], source["weights_at_save"], case + " weights only")
    for ours, ref in zip(run["steps"], source["steps"]):
        assert ours["lr"] == ref["lr"]
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for name, ref in source["final"].items():
        assert torch.allclose(run["final"][name], ref, atol=2e-6, rtol=0), (case, name)
    assert "distributed adam optimizer" in run["kind_error"] and "load_optimizer=False" in run["kind_error"]
