"""RL math of megatron_rl: pure functions over ``[B, R]`` right-aligned tensors (docs/DESIGN.md sections 2, 5, 6).

Place in the data flow: batch tensors -> ``compute_advantages_and_returns`` (whole batch) -> optional
``whiten_advantages`` -> ``normalize_advantages_per_minibatch`` (policy only) -> per micro-batch
``policy_loss_fn`` / ``value_loss_fn`` (summed losses, Metric partials). No Megatron import here.

This package owns the algorithm names (the registries below) and the rules that need them
(``validation.py``); ``megatron_rl.config`` imports them, never the other way round. The math reads its
settings through the ``AlgorithmSettings`` Protocol.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    TEMPORAL_ESTIMATORS,
    compute_advantages_and_returns,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megatron_rl.algorithms.kl import KL_ESTIMATORS, apply_kl_to_rewards, kl_penalty
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    LossContext,
    get_policy_loss,
    policy_loss_fn,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
    value_loss_fn,
)
from megatron_rl.algorithms.normalization import (
    LOSS_REDUCTION_WEIGHTS,
    LOSS_REDUCTIONS,
    masked_mean,
    normalize_advantages_per_minibatch,
    normalize_minibatch_advantages,
    reduction_weights,
    whiten_advantages,
)
from megatron_rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, importance_ratio_metrics, off_policy_weights
from megatron_rl.algorithms.settings import AlgorithmSettings
from megatron_rl.algorithms.validation import (
    validate_algorithm_config,
    validate_algorithm_settings,
    validate_step_wise_algorithm,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_REDUCTIONS", "LOSS_REDUCTION_WEIGHTS", "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES", "TEMPORAL_ESTIMATORS", "AlgorithmSettings", "LossContext", "apply_kl_to_rewards",
    "compute_advantages_and_returns", "get_advantage_estimator", "get_policy_loss", "importance_ratio_metrics",
    "kl_penalty", "masked_mean", "normalize_advantages_per_minibatch", "normalize_minibatch_advantages",
    "off_policy_weights", "policy_loss_fn",
    "ppo_policy_loss", "reduction_weights", "register_advantage_estimator", "register_policy_loss",
    "validate_algorithm_config", "validate_algorithm_settings", "validate_step_wise_algorithm", "value_loss",
    "value_loss_fn", "whiten_advantages",
]
