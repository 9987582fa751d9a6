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

Mixture-of-experts (docs/MOE.md): megatron-core chains a separate optimizer for the expert parameters only when
they use the expert groups (expert_model_parallel_size > 1, or an expert-TP size other than the TP size); at EP1
the experts sit in the dense optimizer's param groups. The per-parameter tensors (moments, fp32 main copies) are
keyed by the model's global names and load under any layout, but the non-sharded parts (param groups with their
hyperparameters, the Adam step) are stored per sub-optimizer, so a checkpoint of another chaining would load the
wrong dicts (megatron fails to match its param groups). ``optimizer_layout`` records the
chaining in the manifest; when it differs at load, ``_load_regrouped`` gives each current sub-optimizer its own
loaded tensors and its param groups' hyperparameters and step from the saved group with the same identifier
(``is_expert_parallel`` aside).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer.optimizer import param_group_identifier_keys

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


OptimizerLayout = list[list[list[Any]]]
"""Per sub-optimizer, the identifier of each of its param groups (values of ``param_group_identifier_keys``)."""

_EXPERT_FLAG = "is_expert_parallel"


def _group_identifier(group: dict, *, with_expert_flag: bool = True) -> list[Any]:
    """megatron-core's identifier of a param group (its ``_filter_and_reorder_param_groups``): the values of
    ``param_group_identifier_keys`` (``pre_<key>`` aliases, missing = None; other than JSON scalars as repr)."""
    keys = [k for k in param_group_identifier_keys if with_expert_flag or k != _EXPERT_FLAG]
    values = [group.get(k, group.get(f"pre_{k}")) for k in keys]
    return [v if v is None or isinstance(v, (bool, int, float, str)) else repr(v) for v in values]  # JSON


def optimizer_layout(optimizer: Any | None) -> OptimizerLayout | None:
    """How ``optimizer`` is chained and grouped, for the manifest (None without an optimizer)."""
    if optimizer is None:
        return None
    return [[_group_identifier(g) for g in sub.optimizer.param_groups] for sub in sub_optimizers(optimizer)]


def sharded_optimizer_state(optimizer: Any, model_sharded: dict, is_loading: bool) -> dict:
    """``optimizer.sharded_state_dict`` for ``model_sharded`` (the model chunks' sharded state dicts)."""
    populate_optimizer_state(optimizer)
    with torch.no_grad():
        return optimizer.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=SHARDING_METADATA)


def _per_sub(state: Any, count: int) -> list[dict]:
    """The state dict of each of ``count`` sub-optimizers in a (chained, or not) optimizer state dict."""
    return [state] if count == 1 else [state[i] for i in range(count)]


def load_optimizer_state(optimizer: Any, state: Any, saved_layout: OptimizerLayout | None = None) -> None:
    """Load what ``dist_checkpointing.load`` returned for the template of ``sharded_optimizer_state``.

    ``saved_layout``: the checkpoint's ``optimizer_layout`` (None: a checkpoint written before it was recorded,
    taken to match). Another chaining of the same param groups (MoE at another EP size) is regrouped.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = sub_optimizers(optimizer)
    current = _per_sub(state, len(subs))
    if saved_layout is not None and saved_layout != optimizer_layout(optimizer):
        _load_regrouped(subs, current, _per_sub(state, len(saved_layout)))
        return
    with torch.no_grad():
        for sub, sub_state in zip(subs, current):
            if isinstance(sub, DistributedOptimizer):
                _load_distributed(sub, sub_state)
            else:
                _restore_zero_step(sub_state.get("optimizer", sub_state))
                sub.load_state_dict(sub_state)
            _own_step_tensors(sub.optimizer)


def _load_regrouped(subs: list[Any], current: list[dict], saved: list[dict]) -> None:
    """Load a checkpoint whose optimizer was chained otherwise (module docstring, "Mixture-of-experts").

    ``current[i]`` holds the tensors loaded for sub-optimizer i (at the paths of this run's template);
    ``saved[j]`` the non-sharded state of the checkpoint's sub-optimizer j (dist_checkpointing merges the
    checkpoint's common dict, in its own structure, with the loaded tensors, in the template's).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    saved_groups = [g for s in saved for g in _torch_level(s, s.get("param_state_sharding_type"))["param_groups"]]
    steps = [step for step in map(_common_step, saved) if step is not None]
    if len({float(step) for step in steps}) > 1:  # megatron's ChainedOptimizer keeps them in step
        raise ValueError(f"checkpoint optimizer: sub-optimizers at different steps {[float(s) for s in steps]}; "
                         "load it with load_optimizer=False")
    step = steps[0] if steps else None
    with torch.no_grad():
        for sub, loaded in zip(subs, current):
            if isinstance(sub, DistributedOptimizer):
                state = sub.state_dict()  # this run's groups and grad scaler (built with the template)
                state["optimizer"]["param_groups"] = _matched_groups(state["optimizer"]["param_groups"],
                                                                     saved_groups)
                state["param_state"] = loaded["param_state"]
                state["param_state_sharding_type"] = SHARDING_METADATA["distrib_optim_sharding_type"]
                _load_distributed(sub, state)
            else:
                state = {k: v for k, v in loaded.items() if not isinstance(k, int)}  # the saved commons are ints
                torch_level = _torch_level(state, None)
                own_groups = sub.optimizer.state_dict()["param_groups"]  # with this run's param ids
                torch_level["param_groups"] = _matched_groups(own_groups, saved_groups)
                torch_level["state"] = {k: v for k, v in torch_level["state"].items() if k != "common_step"}
                if step is not None:
                    torch_level["state"]["common_step"] = step
                _restore_zero_step(torch_level)
                sub.load_state_dict(state)
            _own_step_tensors(sub.optimizer)


def _torch_level(state: dict, sharding_type: str | None) -> dict:
    """The part of a sub-optimizer's state dict that holds the torch optimizer's ``param_groups``."""
    if sharding_type is not None or "optimizer" in state:  # distributed, or mixed precision
        return state["optimizer"]
    return state


def _common_step(saved: dict) -> Any:
    """The Adam step a saved sub-optimizer state holds (local: ``common_step``; distributed: in its groups)."""
    if saved.get("param_state_sharding_type") is not None:
        return next((g["step"] for g in saved["optimizer"]["param_groups"] if "step" in g), None)
    return _torch_level(saved, None).get("state", {}).get("common_step")


def _matched_groups(groups: list[dict], saved_groups: list[dict]) -> list[dict]:
    """``groups`` (this run's, with their ``params`` if they list them) with the hyperparameters of the saved
    group of the same identifier, the expert flag aside; ValueError naming the group when the checkpoint has none."""
    by_identifier: dict[str, dict] = {}
    for group in saved_groups:
        by_identifier.setdefault(repr(_group_identifier(group, with_expert_flag=False)), group)
    matched = []
    for group in groups:
        saved = by_identifier.get(repr(_group_identifier(group, with_expert_flag=False)))
        if saved is None:
            raise ValueError(f"checkpoint optimizer has no param group like this run's {_group_identifier(group)} "
                             f"(keys {param_group_identifier_keys}); load it with load_optimizer=False")
        own = {k: group[k] for k in ("params", _EXPERT_FLAG) if k in group}  # distributed: groups without params
        matched.append({**{k: v for k, v in saved.items() if k != "params"}, **own})
    return matched


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
