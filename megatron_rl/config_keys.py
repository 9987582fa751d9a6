"""The dotted keys a config accepts and how raw values become typed fields: the schema of a config class
(``Schema``), suggestions for unknown keys (an alias table of other frameworks' names, then the closest key),
coercion of YAML and ``key=value`` values to the field types (``build_config``), and writing a config back
(``config_to_dict``, ``write_yaml``). Used by ``config.py: load_config`` and the main job's ``job/config.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, TypeVar

import yaml

from megatron_rl.config_files import ConfigError
from megatron_rl.config_rules import type_hints

# --------------------------------------------------------------------------------------------------------------
# Keys: schema, suggestions for unknown keys
# --------------------------------------------------------------------------------------------------------------

KEY_ALIASES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("learning_rate", "lr"), ("optimizer.lr",)),
    **dict.fromkeys(("lr_warmup", "warmup", "warmup_steps", "num_warmup_steps", "lr_warmup_iters"),
                    ("optimizer.lr_warmup_steps",)),
    **dict.fromkeys(("lr_decay_iters", "decay_steps"), ("optimizer.lr_decay_steps",)),
    "beta1": ("optimizer.adam_beta1",),
    "beta2": ("optimizer.adam_beta2",),
    **dict.fromkeys(("eps", "epsilon", "adam_epsilon"), ("optimizer.adam_eps", "model.layernorm_epsilon")),
    **dict.fromkeys(("grad_clip", "max_grad_norm", "clip_grad_norm", "gradient_clipping"), ("optimizer.clip_grad",)),
    **dict.fromkeys(("tp", "tp_size", "tensor_parallel_size"), ("parallel.tensor_model_parallel_size",)),
    **dict.fromkeys(("pp", "pp_size", "pipeline_parallel_size"), ("parallel.pipeline_model_parallel_size",)),
    **dict.fromkeys(("cp", "cp_size"), ("parallel.context_parallel_size",)),
    **dict.fromkeys(("batch_size", "global_batch_size", "rollout_batch_size"), ("batch.train_batch_size",)),
    **dict.fromkeys(("mini_batch_size", "ppo_mini_batch_size"), ("batch.policy_mini_batch_size",)),
    **dict.fromkeys(("ppo_micro_batch_size", "micro_batch_size_per_gpu"), ("batch.micro_batch_size",)),
    **dict.fromkeys(("max_tokens", "ppo_max_token_len_per_gpu"), ("batch.max_tokens_per_micro_batch",)),
    **dict.fromkeys(("epochs", "ppo_epochs", "num_epochs"), ("batch.update_epochs_per_batch",)),
    **dict.fromkeys(("kl_coef", "kl_coeff"), ("algorithm.kl_loss_coef",)),
    **dict.fromkeys(("entropy_coef", "entropy_coeff"), ("algorithm.entropy_loss_coef",)),
    **dict.fromkeys(("clip_ratio", "clip_ratio_low", "eps_clip", "clip_range"), ("algorithm.eps_clip_low",)),
    "clip_ratio_high": ("algorithm.eps_clip_high",),
    **dict.fromkeys(("lam", "lambda", "gae_lambda"), ("algorithm.lambd",)),
    **dict.fromkeys(("adv_estimator", "estimator"), ("algorithm.advantage_estimator",)),
    "loss_agg_mode": ("algorithm.loss_reduction",),
    "num_hidden_layers": ("model.num_layers",),
    **dict.fromkeys(("lora_rank", "lora_r"), ("model.lora.rank",)),
    "lora_alpha": ("model.lora.alpha",),
    **dict.fromkeys(("freeze_vision_tower", "freeze_vision_encoder", "freeze_vit"), ("model.freeze_vision",)),
    **dict.fromkeys(("target_modules", "lora_target_modules"), ("model.lora.target_modules",)),
    **dict.fromkeys(("ep", "ep_size", "expert_parallel_size"), ("parallel.expert_model_parallel_size",)),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), ("model.num_moe_experts",)),
    **dict.fromkeys(("num_experts_per_tok", "topk", "router_topk"), ("model.moe_router_topk",)),
    "moe_intermediate_size": ("model.moe_ffn_hidden_size",),
    **dict.fromkeys(("router_aux_loss_coef", "aux_loss_coeff"), ("model.moe_aux_loss_coeff",)),
    "intermediate_size": ("model.ffn_hidden_size",),
    "num_key_value_heads": ("model.num_query_groups",),
    "rope_theta": ("model.rotary_base",),
    "rms_norm_eps": ("model.layernorm_epsilon",),
    **dict.fromkeys(("dtype", "precision"), ("model.params_dtype",)),
    **dict.fromkeys(("save_freq", "save_steps"), ("checkpoint.save_interval",)),
    **dict.fromkeys(("cliprange_value", "value_clip_range", "vf_clip"), ("algorithm.value_clip",)),
    **dict.fromkeys(("critic_lr", "value_lr"), ("critic.lr",)),
    **dict.fromkeys(("critic_mini_batch_size", "ppo_critic_mini_batch_size"), ("critic.mini_batch_size",)),
}
"""Common names from other frameworks -> our dotted keys (the first in the key's own section is suggested)."""

KEY_NOTES: dict[str, str] = {
    **dict.fromkeys(("dp", "dp_size", "data_parallel_size"),
                    "the data-parallel size is not set: it is world size / (tensor_model_parallel_size * "
                    "pipeline_model_parallel_size * context_parallel_size); change the number of processes"),
    **dict.fromkeys(("demo", "job", "data", "reward", "eval", "export", "rollout", "next_digit"),
                    "a section of the main job, not of the library config; load the file with "
                    "megatron_rl.job.config.load_job_config (the main job: python -m megatron_rl.job.main)"),
    "n_samples_per_prompt": "the library takes groups from the rows' uids (rows sharing a uid form a group); "
                            "the generator sets the group size (the main job: job.n_samples_per_prompt)",
}
"""Names that have no key of their own, and what to do instead."""


@dataclass(frozen=True)
class Schema:
    """The dotted keys a loader accepts: ``leaves`` (key -> type) and ``sections`` (keys that hold mappings)."""

    leaves: Mapping[str, Any]
    sections: frozenset[str]

    @classmethod
    def of(cls, config_cls: type, prefix: str = "") -> Schema:
        leaves, sections = {}, {prefix[:-1]} if prefix else set()
        for name, hint in type_hints(config_cls).items():
            if typing.get_origin(hint) is ClassVar:
                continue
            if dataclasses.is_dataclass(hint):
                sub = cls.of(hint, f"{prefix}{name}.")
                leaves.update(sub.leaves)
                sections |= sub.sections
            else:
                leaves[prefix + name] = hint
        return cls(leaves, frozenset(sections))

    def __or__(self, other: Schema) -> Schema:
        return Schema({**self.leaves, **other.leaves}, self.sections | other.sections)

    def children(self, section: str) -> list[str]:
        """Names directly under ``section`` ("" = top level)."""
        names = {key[len(section) + 1 if section else 0:].split(".")[0]
                 for key in (*self.leaves, *self.sections) if not section or key.startswith(section + ".")}
        return sorted(names)


def _suggestion(key: str, schema: Schema, aliases: Mapping[str, tuple[str, ...]]) -> str:
    """How to fix the unknown ``key``, first that applies: a leaf used as a section, a note, a misspelled
    section, an alias, the closest name in the key's section, the closest key of another section."""
    *path, name = key.split(".")
    section = ".".join(path)
    for i in range(1, len(path) + 1):
        if ".".join(path[:i]) in schema.leaves:
            return f"; {'.'.join(path[:i])!r} takes a value, not a mapping"
    for part in (name, *path):
        if part in KEY_NOTES and part not in schema.sections:
            return f"; {KEY_NOTES[part]}"
    top = schema.children("")
    if path and path[0] not in top and difflib.get_close_matches(path[0], top, n=1, cutoff=0.6):
        return f"; did you mean {difflib.get_close_matches(path[0], top, n=1, cutoff=0.6)[0]!r}?"
    targets = [t for t in aliases.get(name.lower(), ()) if t in schema.leaves]
    if targets:
        same_section = [t for t in targets if t.rpartition(".")[0] == section]
        return f"; did you mean {(same_section or targets)[0]!r}?"
    if path and path[0] not in top:
        return f"; valid sections: {top}"
    match = difflib.get_close_matches(name, schema.children(section), n=1, cutoff=0.6)
    if match:
        return f"; did you mean {(section + '.' if section else '') + match[0]!r}?"
    elsewhere = [k for k in schema.leaves if k.rpartition(".")[0] != section]
    match = difflib.get_close_matches(key, elsewhere, n=1, cutoff=0.6)
    if match:
        return f"; did you mean {match[0]!r}?"
    return f"; valid keys{' of ' + repr(section) if section else ''}: {schema.children(section)}"


def check_keys(flat: Mapping[str, Any], schema: Schema, aliases: Mapping[str, tuple[str, ...]] = KEY_ALIASES) -> None:
    """Every dotted key of ``flat`` must be a leaf of ``schema``; ConfigError with a suggestion otherwise."""
    for key, value in flat.items():
        if key in schema.leaves:
            continue
        if key in schema.sections:
            raise ConfigError(f"config key {key!r} is a section; give a mapping, not {value!r}")
        raise ConfigError(f"unknown config key {key!r}{_suggestion(key, schema, aliases)}")


# --------------------------------------------------------------------------------------------------------------
# Reading YAML and overrides, building, dumping
# --------------------------------------------------------------------------------------------------------------


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation (after YAML parsing); int -> float is allowed.

    ``Literal`` values pass through: their choices are checked by the section, for configs built in code too.
    """
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError(f"{key}: bad value {value!r}")
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a bool (true/false)")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an int")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    return value


T = TypeVar("T")


def build_config(cls: type[T], flat: Mapping[str, Any], prefix: str = "") -> T:
    """Construct ``cls`` from the dotted keys of ``flat`` under ``prefix`` (keys checked by ``check_keys``).

    Sections are built bottom-up from their final values, so each validates exactly once.
    """
    hints = type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build_config(hints[f.name], flat, key + ".")
        elif key in flat:
            kwargs[f.name] = _coerce(key, flat[key], hints[f.name])
    return cls(**kwargs)


def config_to_dict(cfg: object) -> dict:
    """Plain nested dict of a resolved config (YAML-serializable)."""
    return dataclasses.asdict(cfg)


def write_yaml(data: Mapping[str, Any], path: str | Path) -> None:
    """Write ``data`` as YAML, atomically (temp file + rename: a reader never sees half a file)."""
    from megatron_rl.atomic import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(dict(data), sort_keys=False))
