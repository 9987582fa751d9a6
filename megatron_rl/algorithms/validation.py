"""Validation of ``AlgorithmConfig`` against the algorithm registries (estimators, losses, reductions).

Place in the data flow: run once by the config loader (``megatron_rl.config.validate_config`` calls it), so
a bad combination fails before any model is built. Each error names the field, the value and the fix.
"""

from __future__ import annotations

import warnings

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.losses import POLICY_LOSSES
from megatron_rl.algorithms.normalization import LOSS_REDUCTION_WEIGHTS
from megatron_rl.config import TEMPORAL_ESTIMATORS, AlgorithmConfig

OFF_POLICY_CORRECTIONS = ("none", "token_tis", "sequence_tis")


def _check_choice(field: str, value: object, valid: object) -> None:
    if value not in valid:
        raise ValueError(f"algorithm.{field}={value!r} is not one of {sorted(valid)}; pick one of those")


def _check_range(field: str, value: float, low: float, high: float, fix: str) -> None:
    if not low <= value <= high:
        raise ValueError(f"algorithm.{field}={value!r} must be in [{low}, {high}]; {fix}")


def _check_names(cfg: AlgorithmConfig) -> None:
    _check_choice("advantage_estimator", cfg.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _check_choice("policy_loss_type", cfg.policy_loss_type, POLICY_LOSSES)
    _check_choice("loss_reduction", cfg.loss_reduction, LOSS_REDUCTION_WEIGHTS)
    _check_choice("kl_estimator_type", cfg.kl_estimator_type, KL_ESTIMATORS)
    _check_choice("off_policy_correction", cfg.off_policy_correction, OFF_POLICY_CORRECTIONS)


def _check_numbers(cfg: AlgorithmConfig) -> None:
    _check_range("eps_clip_low", cfg.eps_clip_low, 0.0, 1.0, "it is the lower clip distance 1 - eps_clip_low")
    _check_range("eps_clip_high", cfg.eps_clip_high, 0.0, float("inf"), "use a non-negative clip distance")
    _check_range("gamma", cfg.gamma, 0.0, 1.0, "use a discount in [0, 1]")
    _check_range("lambd", cfg.lambd, 0.0, 1.0, "use a GAE lambda in [0, 1]")
    _check_range("kl_loss_coef", cfg.kl_loss_coef, 0.0, float("inf"), "use a non-negative KL weight")
    _check_range("value_clip", cfg.value_clip, 0.0, float("inf"), "use a non-negative clip range")
    if cfg.policy_loss_type == "dual_clip" and cfg.clip_ratio_c <= 1.0:
        raise ValueError(f"algorithm.clip_ratio_c={cfg.clip_ratio_c!r} must be > 1 with policy_loss_type="
                         "'dual_clip' (the dual clip caps ratios above 1); set e.g. clip_ratio_c=3.0")
    if cfg.off_policy_correction != "none" and cfg.tis_cap < 1.0:
        raise ValueError(f"algorithm.tis_cap={cfg.tis_cap!r} must be >= 1 with off_policy_correction="
                         f"{cfg.off_policy_correction!r} (a cap below 1 down-weights every token); set e.g. 2.0")


def _check_combinations(cfg: AlgorithmConfig, step_wise: bool) -> None:
    if cfg.loss_reduction == "seq_mean_token_sum_norm" and (cfg.max_seq_len is None or cfg.max_seq_len <= 0):
        raise ValueError(f"algorithm.max_seq_len={cfg.max_seq_len!r}: loss_reduction='seq_mean_token_sum_norm' "
                         "needs a positive max_seq_len (its normalizer); set it to the longest prompt + response "
                         "the run allows (the same budget batch conversion warns about)")
    if step_wise and cfg.advantage_estimator in TEMPORAL_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator={cfg.advantage_estimator!r} is temporal and cannot be "
                         "used with step-wise trajectories; use an outcome estimator such as 'grpo' or 'rloo'")
    if step_wise and cfg.use_kl_in_reward:
        raise ValueError("algorithm.use_kl_in_reward=True with step-wise trajectories would drop the KL of every "
                         "step but the last (advantages come from last steps only); use use_kl_loss=True instead")
    if cfg.use_kl_loss and cfg.use_kl_in_reward:
        raise ValueError("algorithm.use_kl_loss=True and algorithm.use_kl_in_reward=True both penalize the KL; "
                         "set one of them to false")
    if not cfg.grpo_norm_by_std and cfg.advantage_estimator != "grpo":
        warnings.warn(f"algorithm.grpo_norm_by_std=False has no effect with advantage_estimator="
                      f"{cfg.advantage_estimator!r}", stacklevel=3)


def validate_algorithm_config(cfg: AlgorithmConfig, step_wise: bool) -> None:
    """Raise ValueError (naming the field) for unknown names, bad ranges and invalid combinations."""
    _check_names(cfg)
    _check_numbers(cfg)
    _check_combinations(cfg, step_wise)

