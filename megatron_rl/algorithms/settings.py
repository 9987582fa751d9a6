"""What the algorithms read from a run's configuration, as a Protocol (no import of ``megatron_rl.config``).

Place in the data flow: every estimator, loss and validator of this package takes ``config: AlgorithmSettings``.
``megatron_rl.config.AlgorithmConfig`` (the ``algorithm`` section of the YAML) satisfies it structurally, and so
does any object with these attributes (tests, other frameworks). The dependency is one way: ``config.py``
imports the registries and validators of this package; this package never imports ``config.py``.
"""

from __future__ import annotations

from typing import Protocol


class AlgorithmSettings(Protocol):
    """The fields of ``algorithm:`` the math reads (documented on ``megatron_rl.config.AlgorithmConfig``)."""

    advantage_estimator: str
    grpo_norm_by_std: bool
    gamma: float
    lambd: float
    policy_loss_type: str
    loss_reduction: str
    max_seq_len: int | None
    eps_clip_low: float
    eps_clip_high: float
    clip_ratio_c: float
    use_kl_loss: bool
    use_kl_in_reward: bool
    kl_loss_coef: float
    kl_estimator_type: str
    entropy_loss_coef: float
    advantage_whitening: bool
    off_policy_correction: str
    tis_cap: float
    is_ratio_low: float
    is_ratio_high: float
    value_clip: float
