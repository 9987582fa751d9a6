"""The model-family registry: which ``Family`` (``base.py``) reads a checkpoint's ``model_type``, and which one a
``ModelConfig`` belongs to. Built in: ``dense.py`` (Llama, Qwen2, Qwen3), ``moe.py`` (Qwen3-MoE, Mixtral),
``qwen35.py`` (the hybrid Qwen3.5), ``qwen2_5_vl.py`` (the vision-language Qwen2.5-VL), ``qwen35_vl.py`` (the
multimodal Qwen3.5: the hybrid and its vision tower).

A family of your own (docs/HF.md section 8): define a ``Family`` (e.g. ``DenseFamily(name=..., model_types=...,
bridges=...)``) in a file and name it with ``model.family=path/to/file.py:NAME`` (or ``package.module:NAME``):
the pre-flight and every rank import that file once and ``register_family`` the object, before the checkpoint
is read, the way ``reward.function`` files reach every rank. In-process library users call ``register_family``.

    family_for_type("qwen3")           -> DENSE          (None for a type no family reads: hf/config.py's
                                                         load_hf_config says which ones are supported)
    family_of(model_cfg)               -> model.family when set (a name or a file.py:NAME), else the built-in
                                          family that builds the config's shapes (hybrid, MoE, dense)
"""

from __future__ import annotations

from typing import Any

from megatron_rl.hf.families.base import Family, Support
from megatron_rl.hf.families.dense import DENSE, DenseFamily
from megatron_rl.hf.families.moe import MOE, MoEFamily
from megatron_rl.hf.families.qwen2_5_vl import QWEN2_5_VL, Qwen25VLFamily
from megatron_rl.hf.families.qwen35 import QWEN35, Qwen35Family
from megatron_rl.hf.families.qwen35_vl import QWEN35_VL, Qwen35VLFamily

__all__ = ["DENSE", "MOE", "QWEN2_5_VL", "QWEN35", "QWEN35_VL", "DenseFamily", "Family", "MoEFamily",
           "Qwen25VLFamily", "Qwen35Family", "Qwen35VLFamily", "Support", "families",
           "family_for_type", "family_of", "register_family", "supported_model_types"]

_FAMILIES: dict[str, Family] = {}
BUILT_IN = (QWEN35, MOE, DENSE)
"""In the order ``family_of`` asks them whether they build a config's shapes."""
FAMILY_KEY = "model.family"


def register_family(family: Family) -> Family:
    """Make ``family`` known (returned, so a module can write ``MINE = register_family(DenseFamily(...))``).
    Registering the same family again is a no-op; ValueError for another family under a name or a
    ``model_type`` already taken."""
    if not isinstance(family, Family):
        raise ValueError(f"{FAMILY_KEY}: {family!r} is not a megatron_rl.hf.families.Family")
    if _FAMILIES.get(family.name) == family:
        return _FAMILIES[family.name]
    taken = [f"{t} ({other.name})" for other in _FAMILIES.values() for t in family.model_types if t in other.model_types]
    if family.name in _FAMILIES or taken:
        raise ValueError(f"model family {family.name!r}: name or model_type already registered "
                         f"({', '.join(taken) or family.name}); choose another name or model_type")
    _FAMILIES[family.name] = family
    return family


for _family in (DENSE, MOE, QWEN35, QWEN2_5_VL, QWEN35_VL):
    register_family(_family)


def families() -> list[Family]:
    return list(_FAMILIES.values())


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for family in _FAMILIES.values() for t in family.model_types)


def family_for_type(model_type: str) -> Family | None:
    """The family that reads ``model_type``, or None."""
    return next((family for family in _FAMILIES.values() if model_type in family.model_types), None)


def load_family(spec: str) -> Family:
    """``model.family``: a registered family's name, or ``path/to/file.py:NAME`` / ``package.module:NAME`` (the
    file imported once per process, the object registered). ConfigError naming the key."""
    from megatron_rl.config import ConfigError

    if spec in _FAMILIES:
        return _FAMILIES[spec]
    if ":" not in spec:
        raise ConfigError(f"{FAMILY_KEY}={spec!r} is not one of {sorted(_FAMILIES)} nor path/to/file.py:NAME of "
                          "a family of your own (docs/HF.md section 8)")
    from megatron_rl.environments.user_code import load_object

    family = load_object(spec, FAMILY_KEY, "family")
    try:
        return register_family(family)
    except ValueError as err:
        raise ConfigError(f"{FAMILY_KEY}={spec!r}: {err}") from None


def family_of(model_cfg: Any) -> Family:
    """The family of a ``ModelConfig``: ``model.family`` when set (the resolved section of a checkpoint names
    it, ``hf/config.py: model_config_from_hf``), else the built-in family that builds its shapes."""
    if getattr(model_cfg, "family", None):
        return load_family(model_cfg.family)
    return next(family for family in BUILT_IN if family.builds(model_cfg) or family is DENSE)
