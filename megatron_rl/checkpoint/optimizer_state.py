"""Megatron optimizer state in and out of ``dist_checkpointing``, with the fixes megatron-core 0.16.1 needs.

Place in the data flow: called by ``checkpoint/dist.py`` while it builds the sharded state dict (save and
load templates) and after ``dist_checkpointing.load``.

The distributed optimizer is saved in the ``fully_reshardable`` format (loads under any TP/PP/DP layout; the
default format fails in 0.16.1). Without Apex/TransformerEngine (native torch Adam) 0.16.1 has three defects
on this path (docs/CHECKPOINTS.md section 6), plus two on the local optimizers, fixed here without touching
megatron-core:

1. ``DistributedOptimizer.state_dict()`` asserts a single Adam ``step`` over the inner state, which is empty
   before the first step: ``populate_optimizer_state`` creates the state Adam would create (step 0, zero
   moments; the same update follows), before building a template or saving.
2. ``load_parameter_state_from_fully_reshardable`` copies every state key including ``step`` (KeyError: the
   format has no per-parameter step) in place into views of leaves requiring grad (RuntimeError):
   ``load_optimizer_state`` takes ``step`` out around that call and runs under ``torch.no_grad``.
3. ``load_state_dict`` puts one shared ``step`` tensor into every parameter's state, so foreach AdamW bumps it
   once per parameter per step: every parameter gets its own copy, with the saved value (kept from the
   checkpoint's param groups, the place 0.16.1 stores the distributed optimizer's step).
4. The local (FP32 / mixed-precision) optimizers drop a step of 0 from the checkpoint (``if step:``), and torch
   Adam cannot load moments without a step: ``_restore_zero_step``.
5. SGD: megatron passes ``init_state_fn=None``, which ``sharded_state_dict(is_loading=True)`` calls
   (TypeError), and torch creates momentum buffers lazily, so a template built before the first step has none
   and the checkpoint's buffers would be skipped silently: a no-op init function and zero buffers.
"""

from __future__ import annotations

from typing import Any

import torch

# Workaround W6 (docs/MEGATRON_CORE.md; 0.16.1, kept for 0.19.2): remove when the default format reshards.
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""``metadata`` passed to ``optimizer.sharded_state_dict`` (ignored by the non-distributed optimizers)."""


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers behind a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_kind(optimizer: Any | None) -> str | None:
    """'distributed' (DistributedOptimizer), 'local' (FP32 / mixed-precision) or None, for the manifest."""
    if optimizer is None:
        return None
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    kinds = {isinstance(sub, DistributedOptimizer) for sub in sub_optimizers(optimizer)}
    assert len(kinds) == 1, "mixed distributed and local sub-optimizers"
    return "distributed" if kinds.pop() else "local"


# Workaround W7 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when DistributedOptimizer.state_dict() accepts an empty state.
def populate_optimizer_state(optimizer: Any) -> None:
    """Create the per-parameter state torch would create at the first step (defects 1 and 5).

    Numerically a no-op: Adam with step 0 and zero moments performs exactly the first update; SGD with a zero
    momentum buffer too (when dampening is 0, torch's and megatron's default).
    """
    for sub in sub_optimizers(optimizer):
        if getattr(sub, "init_state_fn", _no_init) is None:
            sub.init_state_fn = _no_init
        inner = sub.optimizer
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            _populate_adam(inner)
        elif isinstance(inner, torch.optim.SGD):
            _populate_sgd(inner)


# Workaround W11 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when megatron-core passes an SGD state-init function.
def _no_init(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """Stand-in for the ``init_state_fn=None`` megatron gives SGD (its loading template would call None)."""


def _populate_adam(inner: torch.optim.Optimizer) -> None:
    for group in inner.param_groups:
        moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for param in group["params"]:
            state = inner.state[param]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
            for key in moments:
                if key not in state:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _populate_sgd(inner: torch.optim.SGD) -> None:
    for group in inner.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            continue  # no state, or a first step (buffer = grad) that a zero buffer would not reproduce
        for param in group["params"]:
            if inner.state[param].get("momentum_buffer") is None:
                inner.state[param]["momentum_buffer"] = torch.zeros_like(param)


def sharded_optimizer_state(optimizer: Any, model_sharded: dict, is_loading: bool) -> dict:
    """``optimizer.sharded_state_dict`` for ``model_sharded`` (the model chunks' sharded state dicts)."""
    populate_optimizer_state(optimizer)
    with torch.no_grad():
        return optimizer.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=SHARDING_METADATA)


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """Load what ``dist_checkpointing.load`` returned for the template of ``sharded_optimizer_state``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = sub_optimizers(optimizer)
    states = [state] if len(subs) == 1 else [state[i] for i in range(len(subs))]
    with torch.no_grad():
        for sub, sub_state in zip(subs, states):
            if isinstance(sub, DistributedOptimizer):
                _load_distributed(sub, sub_state)
            else:
                _restore_zero_step(sub_state.get("optimizer", sub_state))
                sub.load_state_dict(sub_state)
            _own_step_tensors(sub.optimizer)


# Workaround W8 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when the fully-reshardable load skips `step` and runs under no_grad (0.19.2 fixed half).
def _load_distributed(sub: Any, state: dict) -> None:
    state = dict(state)
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    assert sharding == "fully_reshardable", sharding
    sub.load_state_dict(state)  # param groups (with the saved step), grad scaler; allocates the inner state
    steps = {param: s.pop("step") for param, s in sub.optimizer.state.items() if "step" in s}
    sub.load_parameter_state_from_fully_reshardable(param_state)
    for param, step in steps.items():
        sub.optimizer.state[param]["step"] = step


# Workaround W10 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when local optimizers keep a step of 0 (`if step is not None`).
def _restore_zero_step(torch_state: dict) -> None:
    """Give a local optimizer's loaded state its ``step`` back when it was 0 (defect 4).

    ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params.sharded_state_dict`` save the step as
    ``common_step`` only ``if step:``, so a checkpoint taken before the first optimizer step has moments but no
    step, and torch Adam's ``load_state_dict`` raises KeyError 'step'.
    """
    if "common_step" in torch_state["state"]:
        return
    for state in torch_state["state"].values():
        if isinstance(state, dict) and state and "step" not in state:
            state["step"] = torch.tensor(0.0)


# Workaround W9 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when load_state_dict gives each parameter its own `step` tensor.
def _own_step_tensors(inner: torch.optim.Optimizer) -> None:
    """One ``step`` tensor per parameter (defect 3); a state without one (saved before any step) gets 0."""
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state[param]
            if not state:
                continue
            step = state.get("step")
            state["step"] = torch.tensor(0.0) if step is None else torch.as_tensor(step, dtype=torch.float32).clone()
