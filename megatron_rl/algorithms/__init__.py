"""RL math of megatron_rl: pure functions over ``[B, R]`` right-aligned tensors (DESIGN.md sections 2, 5, 6).

Place in the data flow: batch tensors -> ``compute_advantages_and_returns`` (whole batch) -> optional
``whiten_advantages`` -> ``normalize_advantages_per_minibatch`` (policy only) -> per micro-batch
``policy_loss_fn`` / ``value_loss_fn`` (summed losses, Metric partials). No Megatron import here.

``validate_algorithm_config`` is run by ``megatron_rl.config.validate_config``.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages_and_returns,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megatron_rl.algorithms.kl import KL_ESTIMATORS, apply_kl_to_rewards, kl_penalty
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    LossContext,
    get_policy_loss,
    off_policy_weights,
    policy_loss_fn,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
    value_loss_fn,
)
from megatron_rl.algorithms.normalization import (
    LOSS_REDUCTION_WEIGHTS,
    masked_mean,
    normalize_advantages_per_minibatch,
    normalize_minibatch_advantages,
    reduction_weights,
    whiten_advantages,
)
from megatron_rl.algorithms.validation import validate_algorithm_config

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_REDUCTION_WEIGHTS", "POLICY_LOSSES", "LossContext",
    "apply_kl_to_rewards", "compute_advantages_and_returns", "get_advantage_estimator", "get_policy_loss",
    "kl_penalty", "masked_mean", "normalize_advantages_per_minibatch", "normalize_minibatch_advantages",
    "off_policy_weights", "policy_loss_fn", "ppo_policy_loss", "reduction_weights", "register_advantage_estimator",
    "register_policy_loss", "validate_algorithm_config", "value_loss", "value_loss_fn",
    "whiten_advantages",
]
