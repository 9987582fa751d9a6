"""Trainer: the old-log-prob forward is skipped exactly when the policy cannot move before the update.

Reference: the same step on a twin policy (same weights, single-process ``MegatronPolicy``, Adam) with the
forward kept (``skip_old_logprobs=False``). With one optimizer step per train step the update's forward runs on
the weights the old forward would have used, over the same packs, so old == current and the claim is equality:
the same loss, gradient norm, rollout mismatch and ratio metrics (merged from the update's micro-batches instead
of computed on the whole batch: equal to fp32 rounding of the sums, 1e-6) and bitwise the same updated weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.trainer import Trainer

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=24", "model.attention_backend=local", "parallel.device=cpu"]
BATCH = ["batch.train_batch_size=2", "batch.policy_mini_batch_size=2", "batch.update_epochs_per_batch=1",
         "batch.micro_batch_size=3", "optimizer.optimizer=adam",
         "optimizer.lr=0.01", "optimizer.lr_warmup_steps=0"]


def rollouts() -> dict:
    """Two prompts x three samples; rollout log-probs off by a per-token amount (nonzero mismatch metrics)."""
    responses = [[5, 6, 2], [7, 2], [8, 9, 10, 2], [3, 2], [11, 12], [13, 14, 15, 16, 2], ]
    return {
        "prompt_token_ids": [[1, 4, 9]] * 3 + [[1, 17, 18, 19]] * 3,
        "response_ids": responses,
        "rewards": [1.0, 0.0, 0.5, 0.0, 1.0, 0.2],
        "loss_masks": [[1] * len(r) for r in responses],
        "uids": [0, 0, 0, 1, 1, 1],
        "rollout_logprobs": [[-3.0 - 0.1 * j for j in range(len(r))] for r in responses],
    }


@pytest.fixture(scope="module")
def config_and_groups():
    config = load_config(None, [*MODEL, *BATCH])
    groups = initialize_distributed(config.parallel, seed=7)
    yield config, groups
    destroy_distributed()


def test_skipped_forward_gives_the_same_step(config_and_groups) -> None:
    from megatron_rl.model.policy import MegatronPolicy

    config, groups = config_and_groups
    policies = [MegatronPolicy(config, groups, pad_token_id=0, total_optim_steps=4) for _ in range(2)]
    policies[1].load_full_state_dict(policies[0].full_state_dict())
    forwards = []
    for policy in policies:
        real = policy.forward
        policy.forward = lambda batch, *a, _real=real, **k: forwards.append(1) or _real(batch, *a, **k)
    skipped, kept = (Trainer(config, p, skip_old_logprobs=s).train_step(rollouts())
                     for p, s in zip(policies, (True, False)))
    assert len(forwards) == 1  # the kept one
    assert skipped["timing/old_logprobs_skipped"] == 1.0 and kept["timing/old_logprobs_skipped"] == 0.0
    for name, value in kept.items():
        if not name.startswith("timing/"):
            assert skipped[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert kept["rollout/logprob_abs_diff_max"] > 0.1 and kept["off_policy/ratio_max"] > 1.0  # nontrivial
    weights = [p.full_state_dict() for p in policies]
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
    assert not torch.equal(weights[0]["embedding.word_embeddings.weight"],
                           MegatronPolicy(config, groups, pad_token_id=0).full_state_dict()[
                               "embedding.word_embeddings.weight"])  # the step moved the weights


@pytest.mark.parametrize("change", [
    {"policy_mini_batch_size": 1},  # two optimizer steps: the second sees moved weights
    {"update_epochs_per_batch": 2},
    {"skip_old_logprobs": False},  # the main job under rollout.max_staleness > 0
    {"use_kl_in_reward": True},  # the KL reward reads them before the update
])
def test_kept_when_the_policy_can_move(config_and_groups, change) -> None:
    from megatron_rl.data.batch import TrainingBatch

    config, _ = config_and_groups
    trainer = Trainer(config, policy=type("P", (), {"pad_token_id": 0})(), skip_old_logprobs=True)
    batch = trainer.to_training_batch(trainer.validate_and_merge(rollouts(), {}))
    assert isinstance(batch, TrainingBatch) and not trainer.old_logprobs_needed(batch)
    saved = (config.batch.policy_mini_batch_size, config.batch.update_epochs_per_batch,
             config.algorithm.use_kl_in_reward)
    try:
        for key, value in change.items():
            target = trainer if key == "skip_old_logprobs" else (
                config.algorithm if key == "use_kl_in_reward" else config.batch)
            setattr(target, key, value)
        assert trainer.old_logprobs_needed(batch)
    finally:
        (config.batch.policy_mini_batch_size, config.batch.update_epochs_per_batch,
         config.algorithm.use_kl_in_reward) = saved
