"""validate_algorithm_config: estimator / loss / reduction combinations, each error naming its field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import megatron_rl.algorithms  # noqa: F401  (registers the config hook)
from megatron_rl.algorithms import validate_algorithm_config
from megatron_rl.config import AlgorithmConfig, MegatronRLConfig, StepWiseConfig, validate_config

BAD = [
    (dict(advantage_estimator="ppo"), False, "advantage_estimator"),
    (dict(policy_loss_type="clipped"), False, "policy_loss_type"),
    (dict(loss_reduction="mean"), False, "loss_reduction"),
    (dict(kl_estimator_type="k4"), False, "kl_estimator_type"),
    (dict(off_policy_correction="tis"), False, "off_policy_correction"),
    (dict(loss_reduction="seq_mean_token_sum_norm"), False, "max_seq_len"),
    (dict(advantage_estimator="gae"), True, "advantage_estimator"),
    (dict(advantage_estimator="reinforce++"), True, "advantage_estimator"),
    (dict(use_kl_in_reward=True), True, "use_kl_in_reward"),
    (dict(use_kl_in_reward=True, use_kl_loss=True), False, "use_kl_loss"),
    (dict(policy_loss_type="dual_clip", clip_ratio_c=1.0), False, "clip_ratio_c"),
    (dict(off_policy_correction="token_tis", tis_cap=0.5), False, "tis_cap"),
    (dict(eps_clip_low=1.5), False, "eps_clip_low"),
    (dict(eps_clip_high=-0.1), False, "eps_clip_high"),
    (dict(gamma=1.1), False, "gamma"),
    (dict(lambd=-0.1), False, "lambd"),
    (dict(kl_loss_coef=-1.0), False, "kl_loss_coef"),
    (dict(value_clip=-1.0), False, "value_clip"),
]


@pytest.mark.parametrize("fields,step_wise,name", BAD)
def test_bad_combinations_name_the_field(fields, step_wise, name):
    with pytest.raises(ValueError, match=f"algorithm.{name}"):
        validate_algorithm_config(AlgorithmConfig(**fields), step_wise=step_wise)


@pytest.mark.parametrize("step_wise", [False, True])
def test_good_combinations_pass(step_wise):
    for fields in (dict(), dict(advantage_estimator="rloo", policy_loss_type="gspo", loss_reduction="sequence_mean"),
                   dict(loss_reduction="seq_mean_token_sum_norm", max_seq_len=64, grpo_norm_by_std=False),
                   dict(policy_loss_type="dual_clip", use_kl_loss=True, off_policy_correction="sequence_tis")):
        validate_algorithm_config(AlgorithmConfig(**fields), step_wise=step_wise)
    if not step_wise:
        validate_algorithm_config(AlgorithmConfig(advantage_estimator="gae", use_kl_in_reward=True), False)


def test_no_effect_setting_warns():
    with pytest.warns(UserWarning, match="grpo_norm_by_std"):
        validate_algorithm_config(AlgorithmConfig(advantage_estimator="rloo", grpo_norm_by_std=False), False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_algorithm_config(AlgorithmConfig(), False)


def test_hook_runs_in_validate_config():
    cfg = MegatronRLConfig(algorithm=AlgorithmConfig(policy_loss_type="nope"))
    with pytest.raises(ValueError, match="policy_loss_type"):
        validate_config(cfg)
    step_wise = dataclasses.replace(MegatronRLConfig(), stepwise=StepWiseConfig(step_wise_trajectories=True),
                                    algorithm=AlgorithmConfig(use_kl_in_reward=True))
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        validate_config(step_wise)
