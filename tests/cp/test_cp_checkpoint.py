"""Checkpoints across context-parallel sizes: saved at CP1 load at CP2, saved at CP2 load at CP1 (gloo).

CP does not shard weights, but it changes the distributed optimizer's shards (DDP's group is DP x CP), so the
Adam state must be resharded on load. Three spawns:

  cp1 (1 rank)    Adam (distributed optimizer), step 1, save A; step 2 -> weights W2
  cp2 (2 ranks)   load A: the weights are A's bitwise; step 2 -> W2 (same math in another layout: float
                  tolerance); save B; step 3 -> W3
  cp1 (1 rank)    load B: B's weights bitwise; step 3 -> W3 (tolerance)

A load that dropped the Adam moments or the step count would move the weights by O(lr) = 1e-2, far outside
the 1e-5 relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_helpers import batch_tensors, init, make_batch, make_config, max_rel_err, summed_pg_loss
from tests.support.multirank import run_ranks

pytestmark = pytest.mark.multirank


def _policy(cp: int):
    from megatron_rl.model.policy import MegatronPolicy

    cfg = make_config(cp=cp, optimizer="adam", distributed=True)
    cfg.optimizer.lr = 0.01
    cfg.batch.micro_batch_size = 4
    groups = init(cfg)
    return MegatronPolicy(cfg, groups)


def _step(policy, tensors) -> None:
    policy.forward_backward(make_batch(tensors), summed_pg_loss, None)
    policy.optim_step()


def _weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.full_state_dict().items()}


def _cp1_save(rank, world_size, tensors, save_dir):
    from megatron_rl.checkpoint import save_checkpoint

    policy = _policy(cp=1)
    _step(policy, tensors)
    save_checkpoint(policy, save_dir, {"step": 1})
    saved = _weights(policy)
    _step(policy, tensors)
    return {"saved": saved, "w2": _weights(policy)}


def _cp2_load_save(rank, world_size, tensors, load_dir, save_dir):
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

    policy = _policy(cp=2)
    state = load_checkpoint(policy, load_dir)
    out = {"state": state, "loaded": _weights(policy)}
    _step(policy, tensors)
    out["w2"] = _weights(policy)
    save_checkpoint(policy, save_dir, {"step": 2})
    _step(policy, tensors)
    out["w3"] = _weights(policy)
    return out


def _cp1_load(rank, world_size, tensors, load_dir):
    from megatron_rl.checkpoint import load_checkpoint

    policy = _policy(cp=1)
    state = load_checkpoint(policy, load_dir)
    out = {"state": state, "loaded": _weights(policy)}
    _step(policy, tensors)
    out["w3"] = _weights(policy)
    return out


def test_checkpoint_cp1_to_cp2_and_back(tmp_path):
    tensors = batch_tensors()
    a, b = tmp_path / "cp1", tmp_path / "cp2"
    first = run_ranks(1, _cp1_save, tensors, str(a), timeout=300)[0]
    cp2 = run_ranks(2, _cp2_load_save, tensors, str(a), str(b), timeout=300)
    back = run_ranks(1, _cp1_load, tensors, str(b), timeout=300)[0]
    for res in cp2:
        assert res["state"]["step"] == 1
        assert all(torch.equal(res["loaded"][k], first["saved"][k]) for k in first["saved"])
        assert max_rel_err(res["w2"], first["w2"]) < 1e-5
    assert back["state"]["step"] == 2
    assert all(torch.equal(back["loaded"][k], cp2[0]["w2"][k]) for k in cp2[0]["w2"])
    assert max_rel_err(back["w3"], cp2[0]["w3"]) < 1e-5
    # the steps moved the weights far more than the tolerance (the comparison is not vacuous)
    assert max_rel_err(first["w2"], first["saved"]) > 1e-3
