"""MoE checkpoints reshard across expert parallelism (2 gloo ranks, one spawn; docs/CHECKPOINTS.md section 4).

A small MoE policy (4 experts, top-2, load-balancing and z-loss on, Adam with LR warmup + decay) in three
layouts on the same 2 ranks, for the local (FP32) and the distributed optimizer:

  EP2   (experts 0-1 on rank 0, 2-3 on rank 1; dense parts DP2): STEPS uninterrupted steps with a checkpoint
        after step 1 (Adam moments non-zero), then a fresh EP2 policy resumed from it runs steps 2..STEPS.
  EP1   (every rank holds all 4 experts; DP2): loads the EP2 checkpoint, saves it again at once (its own layout),
        then takes step 2 (same math, other summation order: float tolerance).
  EP2'  loads the EP1 checkpoint: the round trip EP2 -> EP1 -> EP2 and then steps 2..STEPS.

Checked: the loaded weights (``full_state_dict``, every expert under its global number) equal the EP2 run's at
the save bitwise in every layout; the resumed EP2 run and the round trip continue bitwise as the uninterrupted
run (losses, grad norms, LRs, final weights), which they only can with the Adam moments and the LR schedule of
every expert restored exactly. A 1-rank load (EP1, DP1) of the EP2 checkpoint is checked in a second spawn.
Without the regrouping of ``checkpoint/optimizer_state.py`` (megatron-core chains a separate expert optimizer at
EP2 but not at EP1) the EP1 load fails in megatron's param-group matching.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support.ckpt_helpers import full_weights, make_batch, make_config, train_step
from tests.support.multirank import run_ranks
from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

STEPS, SAVE_AT = 3, 1
OPTIMIZERS = ("local", "distributed")


def moe_config(ep: int, *, distributed: bool):
    """``ckpt_helpers.make_config`` with an MoE model (4 experts, top-2, aux and z-loss) at EP ``ep``."""
    from megatron_rl.config import ModelConfig, ParallelConfig

    base = make_config(distributed=distributed)
    model = dataclasses.replace(base.model, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    assert isinstance(model, ModelConfig)
    return dataclasses.replace(base, model=model, parallel=ParallelConfig(expert_model_parallel_size=ep))


def _policy(config):
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    groups = initialize_distributed(config.parallel, seed=config.seed)
    assert groups.ep_size == config.parallel.expert_model_parallel_size
    return MegatronPolicy(config, groups), groups


def _ep2_run(distributed: bool, save_dir: Path) -> dict:
    """Uninterrupted EP2 run with a save after SAVE_AT, then a fresh EP2 policy resumed from it."""
    from megatron_rl.model.policy import MegatronPolicy

    config = moe_config(2, distributed=distributed)
    policy, groups = _policy(config)
    batch = make_batch()
    out: dict = {"steps": []}
    for k in range(1, STEPS + 1):
        out["steps"].append(train_step(policy, batch))
        if k == SAVE_AT:
            save_checkpoint(policy, save_dir, {"step": k})
            out["at_save"] = full_weights(policy)
    out["final"] = full_weights(policy)
    resumed = MegatronPolicy(config, groups)
    out["trainer_state"] = load_checkpoint(resumed, save_dir)
    out["resumed_loaded"] = full_weights(resumed)
    out["resumed_steps"] = [train_step(resumed, batch) for _ in range(STEPS - SAVE_AT)]
    out["resumed_final"] = full_weights(resumed)
    return out


def _load_run(ep: int, distributed: bool, source: Path, save_dir: Path | None = None) -> dict:
    """Load ``source`` at EP ``ep``, optionally save it again at once (this layout), then train on."""
    config = moe_config(ep, distributed=distributed)
    policy, _ = _policy(config)
    batch = make_batch()
    out = {"trainer_state": load_checkpoint(policy, source), "loaded": full_weights(policy)}
    if save_dir is not None:
        save_checkpoint(policy, save_dir, out["trainer_state"])
    out["steps"] = [train_step(policy, batch) for _ in range(STEPS - SAVE_AT)]
    out["final"] = full_weights(policy)
    return out


def _two_rank_child(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    out = {}
    for kind in OPTIMIZERS:
        distributed = kind == "distributed"
        ep2, ep1 = root / kind / "ep2", root / kind / "ep1"
        out[kind] = {
            "ep2": _ep2_run(distributed, ep2),
            "ep1": _load_run(1, distributed, ep2, save_dir=ep1),
            "ep2_again": _load_run(2, distributed, ep1),
        }
    return out if rank == 0 else {}


def _one_rank_child(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    return {kind: _load_run(1, kind == "distributed", root / kind / "ep2") for kind in OPTIMIZERS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_moe"))
    two = run_ranks(2, _two_rank_child, root, timeout=900)[0]
    one = run_ranks(1, _one_rank_child, root, timeout=300)[0]
    return {kind: {**two[kind], "ep1_single": one[kind]} for kind in OPTIMIZERS}


def _assert_equal_weights(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        assert torch.equal(got[name], want[name]), (what, name, (got[name] - want[name]).abs().max().item())


@pytest.mark.multirank  # the runs fixture spawns 2 ranks, then 1 (conftest adds `slow`)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_expert_weights_load_bitwise_under_every_ep(runs, kind):
    run = runs[kind]
    reference = run["ep2"]["at_save"]
    experts = [name for name in reference if ".mlp.experts.local_experts." in name]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2): all experts, global numbers
    _assert_equal_weights(run["ep2"]["resumed_loaded"], reference, "EP2 -> EP2")
    _assert_equal_weights(run["ep1"]["loaded"], reference, "EP2 -> EP1 (2 ranks)")
    _assert_equal_weights(run["ep1_single"]["loaded"], reference, "EP2 -> EP1 (1 rank)")
    _assert_equal_weights(run["ep2_again"]["loaded"], reference, "EP2 -> EP1 -> EP2")
    for name in ("ep1", "ep1_single", "ep2_again"):
        assert run[name]["trainer_state"] == {"step": SAVE_AT}


@pytest.mark.multirank  # the runs fixture spawns 2 ranks, then 1 (conftest adds `slow`)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_resume_continues_bitwise(runs, kind):
    ep2 = runs[kind]["ep2"]
    after = ep2["steps"][SAVE_AT:]
    assert after[0]["lr"] != after[1]["lr"]  # the schedule moves: its state matters
    for name, run in (("EP2 resumed", {"steps": ep2["resumed_steps"], "final": ep2["resumed_final"]}),
                      ("EP2 -> EP1 -> EP2", runs[kind]["ep2_again"])):
        assert run["steps"] == after, name  # losses, grad norms, LRs: exact floats
        _assert_equal_weights(run["final"], ep2["final"], name)


@pytest.mark.multirank  # the runs fixture spawns 2 ranks, then 1 (conftest adds `slow`)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_steps_after_an_ep_change_match_to_float_tolerance(runs, kind):
    ep2 = runs[kind]["ep2"]
    for name in ("ep1", "ep1_single"):
        run = runs[kind][name]
        for ours, ref in zip(run["steps"], ep2["steps"][SAVE_AT:]):
            assert ours["lr"] == ref["lr"]
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5), name
            assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        for param, ref in ep2["final"].items():
            assert torch.allclose(run["final"][param], ref, atol=2e-6, rtol=0), (name, param)


def test_moe_fields_are_shape_fields():
    """A dense checkpoint does not load into an MoE model (nor back), named in the error; a manifest written
    before MoE existed (no MoE fields) still matches a dense config."""
    from megatron_rl.checkpoint.dist import model_shape_mismatches

    dense = dataclasses.asdict(make_config().model)
    moe = dataclasses.asdict(moe_config(1, distributed=False).model)
    assert model_shape_mismatches(dense, moe, "checkpoint") == [
        "num_moe_experts: checkpoint None vs config 4", "moe_ffn_hidden_size: checkpoint None vs config 32"]
    assert model_shape_mismatches({**moe, "moe_ffn_hidden_size": None}, {**moe, "moe_ffn_hidden_size": 128},
                                  "checkpoint") == []  # None means ffn_hidden_size (128)
    before_moe = {k: v for k, v in dense.items() if "moe" not in k}
    assert model_shape_mismatches(before_moe, dense, "checkpoint") == []
