"""``model.freeze_vision`` (docs/VISION.md section 13), once per family (the tiny Qwen2.5-VL and Qwen3.5 of
tests/support): one Adam step (weight decay on) of a frozen-tower policy leaves the tower bitwise unchanged and
moves the language model; its grad norm is the unfrozen policy's gradient norm over the language model's
parameters only (the reference, computed here from the unfrozen policy's finalized grads); the optimizer holds no
tower parameter and no state for one; the weight-sync stream (``hf/weights.py: iter_stage_hf_weights``, what
``inference/vllm/weight_sync.py`` sends) has no ``visual`` tensor, the HF export still has the tower; a distributed
checkpoint resumes bitwise, the Adam state included (a second step after the resume equals the uninterrupted one).

Planted bugs (negative controls, in the test): the unfrozen policy's tower with its gradients zeroed but still in
the optimizer (what a freeze by zeroing gradients would do): Adam's weight decay moves its matrices, so the "unchanged" check
fails on it; the unfrozen policy's stream holds every tower tensor (the "no visual" check fails on it).
A text-only checkpoint with ``freeze_vision`` is refused in one line (``hf/config.py: model_config_from_hf``), and
so is a text model built from ``model.*`` shapes (``MegatronPolicy.build_module``).
Cost: ~6 s CPU per family (one process: three policies, a checkpoint).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.core

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny):
    return tiny.save_checkpoint(tmp_path_factory.mktemp(tiny.__name__.rsplit(".")[-1]) / "tiny")


def adam_policy(checkpoint, groups, freeze_vision: bool):
    """``policy_from_hf`` of the checkpoint: Adam (lr 1e-2, weight decay 0.1: a parameter left in the optimizer
    moves even with a zero gradient), clipping far above the norm (so the norm is measured)."""
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig
    from megatron_rl.hf.weights import policy_from_hf

    cfg = MegatronRLConfig(seed=1234, model=ModelConfig(attention_backend="local", freeze_vision=freeze_vision),
                           optimizer=OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1e6))
    return policy_from_hf(cfg, groups, hf_dir=checkpoint)


def tower_names(state: dict) -> list[str]:
    return [name for name in state if name.startswith("visual.")]


def moved(before: dict, after: dict, names: list[str]) -> list[str]:
    return [name for name in names if not torch.equal(before[name], after[name])]


def optimizer_params(policy) -> set[int]:
    return {id(p) for group in policy.optimizer.param_groups for p in group["params"]}


def stream_names(policy, checkpoint, groups) -> list[str]:
    from megatron_rl.hf.weights import iter_stage_hf_weights

    return [name for name, _ in iter_stage_hf_weights([policy.module], checkpoint, groups)]


def test_a_frozen_tower_is_not_trained_synced_or_lost(groups, checkpoint, tmp_path, tiny):
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.hf.weights import iter_hf_weights
    from tests.model.test_policy_multirank import summed_pg_loss
    from tests.support.batches import training_batch

    tensors, _ = tiny.batch_tensors()
    batch = training_batch(tensors)
    frozen = adam_policy(checkpoint, groups, freeze_vision=True)
    before = {k: v.clone() for k, v in frozen.full_state_dict().items()}
    tower = tower_names(before)
    assert len(tower) == tiny.VISION_TENSORS
    frozen.forward_backward(batch, summed_pg_loss, None)
    grad_norm = frozen.optim_step()["grad_norm"]
    after = {k: v.clone() for k, v in frozen.full_state_dict().items()}
    assert moved(before, after, tower) == []
    assert len(moved(before, after, list(before))) == len(before) - len(tower)  # every language tensor moved

    visual = list(frozen.module.visual.parameters())
    assert not optimizer_params(frozen) & {id(p) for p in visual}
    assert len(frozen.optimizer.state_dict()["state"]) == len(optimizer_params(frozen)) \
        == sum(1 for p in frozen.module.parameters() if p.requires_grad) == len(list(frozen.module.parameters())) - len(visual)

    # the reference: the unfrozen policy's finalized gradient, its norm over the language model's parameters
    unfrozen = adam_policy(checkpoint, groups, freeze_vision=False)
    unfrozen.forward_backward(batch, summed_pg_loss, None)
    unfrozen.finalize_grads()
    language = math.sqrt(sum(float(p.main_grad.double().square().sum())
                             for p in unfrozen.module.language_model.parameters()))
    assert abs(grad_norm - language) <= TOL * language
    tower_grad = math.sqrt(sum(float(p.main_grad.double().square().sum()) for p in unfrozen.module.visual.parameters()))
    assert tower_grad > 1e-3 * language  # the tower has a gradient to leave out
    # planted: the tower left in the optimizer with its gradients zeroed; weight decay moves its matrices
    for p in unfrozen.module.visual.parameters():
        p.main_grad.zero_()
    unfrozen.optim_step()
    decayed = [name for name in tower if before[name].dim() > 1]  # megatron-core decays no bias and no norm
    assert moved(before, unfrozen.full_state_dict(), tower) == decayed != []

    # the weight sync's stream skips the tower (the unfrozen policy's holds all of it); the export keeps it
    assert [n for n in stream_names(frozen, checkpoint, groups) if "visual." in n] == []
    assert sum("visual." in n for n in stream_names(unfrozen, checkpoint, groups)) == tiny.VISION_TENSORS
    exported = {name: t for name, t in iter_hf_weights([frozen.module], checkpoint, groups) if "visual." in name}
    assert len(exported) == tiny.VISION_TENSORS
    assert all(torch.equal(t, before[name[name.index("visual."):]]) for name, t in exported.items())

    # a distributed checkpoint resumes bitwise: the tower, and the Adam state (a second step agrees)
    save_checkpoint(frozen, tmp_path / "save", {"step": 1})
    fresh = adam_policy(checkpoint, groups, freeze_vision=True)
    assert load_checkpoint(fresh, tmp_path / "save")["step"] == 1
    for policy in (frozen, fresh):
        policy.forward_backward(batch, summed_pg_loss, None)
        policy.optim_step()
    want, got = frozen.full_state_dict(), fresh.full_state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert moved(before, got, tower) == []


def test_freeze_vision_is_refused_for_a_text_model(tmp_path, groups):
    from megatron_rl.config import MegatronRLConfig, ModelConfig
    from megatron_rl.hf.config import model_config_from_hf
    from megatron_rl.model.policy import MegatronPolicy
    from transformers import Qwen2Config

    path = tmp_path / "qwen2"
    Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(path)  # its config is all the check reads
    with pytest.raises(ValueError, match=r"model\.freeze_vision=true but .* has no vision tower .* set "
                                         r"model\.freeze_vision=false"):
        model_config_from_hf(path, base=dataclasses.replace(ModelConfig(), freeze_vision=True))
    with pytest.raises(ValueError, match=r"model\.freeze_vision=true but this model has no vision tower"):
        MegatronPolicy(MegatronRLConfig(model=ModelConfig(freeze_vision=True)), groups)  # from model.* shapes
