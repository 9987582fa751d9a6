"""validate_algorithm_config: estimator / loss / reduction combinations, each error naming its field.

The algorithm section runs these rules when it is built (and the root config the step-wise ones), so a bad
``AlgorithmConfig(...)`` already raises where it is constructed.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import pytest

from megatron_rl.algorithms import validate_algorithm_config
from megatron_rl.algorithms.settings import AlgorithmSettings
from megatron_rl.config import AlgorithmConfig, MegatronRLConfig, StepWiseConfig

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
    (dict(off_policy_correction="sequence_tis", tis_cap=0.5), False, "tis_cap"),
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
                   dict(policy_loss_type="dual_clip", use_kl_loss=True, off_policy_correction="sequence_tis"),
                   # tis_cap has no effect with a masking mode, so it is not checked against 1 there
                   dict(off_policy_correction="token_mask", tis_cap=0.5, is_ratio_low=0.9, is_ratio_high=1.1),
                   dict(policy_loss_type="gspo", off_policy_correction="sequence_mis"),
                   dict(off_policy_correction="sequence_mis_geo")):
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
    with pytest.raises(ValueError, match="policy_loss_type"):
        MegatronRLConfig(algorithm=AlgorithmConfig(policy_loss_type="nope"))
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        dataclasses.replace(MegatronRLConfig(), stepwise=StepWiseConfig(step_wise_trajectories=True),
                            algorithm=AlgorithmConfig(use_kl_in_reward=True))
    mutated = MegatronRLConfig(stepwise=StepWiseConfig(step_wise_trajectories=True))
    mutated.algorithm.use_kl_in_reward = True  # after construction: the explicit re-check catches it
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        mutated.validate()


def test_algorithm_config_satisfies_the_settings_protocol():
    """The Protocol the math reads lists real fields of AlgorithmConfig, with the same types."""
    fields = {f.name: f.type for f in dataclasses.fields(AlgorithmConfig)}
    for name, annotation in AlgorithmSettings.__annotations__.items():
        assert fields.get(name) == annotation, (name, annotation, fields.get(name))


def test_algorithms_never_import_config():
    """The dependency is one way: config.py imports the registries, the algorithms package never config.py."""
    code = "import sys, megatron_rl.algorithms; assert 'megatron_rl.config' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
