"""Rules of the ``algorithm`` section that need the algorithm registries (estimators, losses, reductions, KL).

Place in the data flow: run when the config is built (``megatron_rl.config.AlgorithmConfig`` calls
``validate_algorithm_settings``; the root ``MegatronRLConfig`` calls ``validate_step_wise_algorithm`` with the
``stepwise`` section's switch), so a bad combination fails before any model is built. Numeric ranges that do not
depend on a name (``gamma`` in [0, 1], ...) are declared on the dataclass fields in ``config.py``. Each error
names the field, the value and the fix. This module never imports ``megatron_rl.config``.
"""

from __future__ import annotations

import warnings
from typing import Iterable

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, TEMPORAL_ESTIMATORS
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.losses import POLICY_LOSSES
from megatron_rl.algorithms.normalization import LOSS_REDUCTION_WEIGHTS
from megatron_rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, TIS_CORRECTIONS
from megatron_rl.algorithms.settings import AlgorithmSettings


def _check_choice(field: str, value: object, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ValueError(f"algorithm.{field}={value!r} is not registered; valid: {sorted(valid)}")


def _check_names(cfg: AlgorithmSettings) -> None:
    _check_choice("advantage_estimator", cfg.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _check_choice("policy_loss_type", cfg.policy_loss_type, POLICY_LOSSES)
    _check_choice("loss_reduction", cfg.loss_reduction, LOSS_REDUCTION_WEIGHTS)
    _check_choice("kl_estimator_type", cfg.kl_estimator_type, KL_ESTIMATORS)
    _check_choice("off_policy_correction", cfg.off_policy_correction, OFF_POLICY_CORRECTIONS)


def _check_name_dependent_values(cfg: AlgorithmSettings) -> None:
    if cfg.policy_loss_type == "dual_clip" and cfg.clip_ratio_c <= 1.0:
        raise ValueError(f"algorithm.clip_ratio_c={cfg.clip_ratio_c!r} must be > 1 with policy_loss_type="
                         "'dual_clip' (the dual clip caps ratios above 1); set e.g. clip_ratio_c=3.0")
    if cfg.off_policy_correction in TIS_CORRECTIONS and cfg.tis_cap < 1.0:
        raise ValueError(f"algorithm.tis_cap={cfg.tis_cap!r} must be >= 1 with off_policy_correction="
                         f"{cfg.off_policy_correction!r} (a cap below 1 down-weights every token); set e.g. 2.0")
    if cfg.loss_reduction == "seq_mean_token_sum_norm" and (cfg.max_seq_len is None or cfg.max_seq_len <= 0):
        raise ValueError(f"algorithm.max_seq_len={cfg.max_seq_len!r}: loss_reduction='seq_mean_token_sum_norm' "
                         "needs a positive max_seq_len (its normalizer); set it to the longest prompt + response "
                         "the run allows (the same budget batch conversion warns about)")


def _check_combinations(cfg: AlgorithmSettings) -> None:
    if cfg.use_kl_loss and cfg.use_kl_in_reward:
        raise ValueError("algorithm.use_kl_loss=True and algorithm.use_kl_in_reward=True both penalize the KL; "
                         "set one of them to false")
    if not cfg.grpo_norm_by_std and cfg.advantage_estimator != "grpo":
        warnings.warn(f"algorithm.grpo_norm_by_std=False has no effect with advantage_estimator="
                      f"{cfg.advantage_estimator!r}", stacklevel=4)


def validate_algorithm_settings(cfg: AlgorithmSettings) -> None:
    """The section's own rules: registered names, name-dependent values, combinations (ValueError)."""
    _check_names(cfg)
    _check_name_dependent_values(cfg)
    _check_combinations(cfg)


def validate_step_wise_algorithm(cfg: AlgorithmSettings, step_wise: bool) -> None:
    """Rules against ``stepwise.step_wise_trajectories`` (advantages come from each trajectory's last step)."""
    if not step_wise:
        return
    if cfg.advantage_estimator in TEMPORAL_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator={cfg.advantage_estimator!r} is temporal and cannot be "
                         "used with step-wise trajectories; use an outcome estimator such as 'grpo' or 'rloo'")
    if cfg.use_kl_in_reward:
        raise ValueError("algorithm.use_kl_in_reward=True with step-wise trajectories would drop the KL of every "
                         "step but the last (advantages come from last steps only); use use_kl_loss=True instead")


def validate_algorithm_config(cfg: AlgorithmSettings, step_wise: bool) -> None:
    """Both of the above: every registry rule of an algorithm section used with or without step-wise."""
    validate_algorithm_settings(cfg)
    validate_step_wise_algorithm(cfg, step_wise)
