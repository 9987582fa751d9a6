"""Reading config files and dotted overrides into flat ``{dotted key: raw value}`` dicts (no torch, no schema).

Place in the data flow: the first step of loading a config (``megatron_rl.config.load_config``, the main job's
``job/config.py: load_job_config``) and of the launch's first line (``job/paths.py``, which must stay fast: it
runs before the pre-flight). Values are YAML-parsed but not checked: ``megatron_rl.config`` checks them against
the schema. ``ConfigError`` lives here so that both sides raise the same class (``megatron_rl.config`` re-exports
it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

logger = logging.getLogger(__name__)

EITHER_OR = (("batch.micro_batch_size", "batch.max_tokens_per_micro_batch"),)
"""Pairs of keys of which exactly one applies. A layer (a config file, or the overrides) that sets one of a pair
and not the other sets the other to null: the later layer chose the rule (``batch.micro_batch_size=4`` over
``configs/user_job.yaml``'s token budget needs no ``batch.max_tokens_per_micro_batch=null``); the same holds
against the schema's defaults. Setting both in one layer is left to the schema's check (one line naming both)."""


class ConfigError(ValueError):
    """A mistake in the user's configuration; the message names the key, the value and the fix."""


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML config file holds ({} for an empty file); ConfigError naming the file otherwise."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML file (e.g. "
                          "configs/demo_cpu.yaml)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err}); pass a readable YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def put_dotted(flat: dict[str, Any], key: str, value: Any, renames: Mapping[str, str]) -> None:
    """Set ``key`` (nested mappings become dotted keys); the latest value of a key wins."""
    if isinstance(value, dict):
        for name, sub in value.items():
            put_dotted(flat, f"{key}.{name}", sub, renames)
        return
    key = renames.get(key, key)
    flat.pop(key, None)
    flat[key] = value


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. optimizer.lr=1e-5)")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({getattr(err, 'problem', err)})") from None


def config_paths(path: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The YAML files of ``path`` (one, several, or none), in the order they apply."""
    if path is None:
        return []
    return [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]


def config_arguments(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(config files, overrides)`` of a launcher's ``--config A --config B ... key=value ...`` (other options and
    their values, e.g. ``--world-size 2``, left out)."""
    files, overrides, rest = [], [], list(argv)
    while rest:
        item = rest.pop(0)
        if item == "--config" and rest:
            files.append(rest.pop(0))
        elif "=" in item and not item.startswith("-"):
            overrides.append(item)
    return files, overrides


def read_overrides(path: str | Path | Sequence[str | Path] | None, overrides: Sequence[str] = (), *,
                   renames: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{dotted key: raw value}`` from the YAML file(s) at ``path`` (several: each one over the ones before),
    then the dotted ``overrides`` (later wins).

    ``renames`` maps keys that moved to their new place (read from either spelling).
    """
    flat: dict[str, Any] = {}
    for file in config_paths(path):
        layer: dict[str, Any] = {}
        for name, value in read_yaml(file).items():
            put_dotted(layer, str(name), value, renames or {})
        _merge_layer(flat, layer)
    layer = {}
    for item in overrides:
        put_dotted(layer, *_parse_override(item), renames or {})
    _merge_layer(flat, layer)
    for mine, other in _either_or_pairs():  # against the schema's defaults: the other unset counts as null
        if flat.get(mine) is not None and other not in flat:
            flat[other] = None
    return flat


def _either_or_pairs() -> list[tuple[str, str]]:
    return [pair for a, b in EITHER_OR for pair in ((a, b), (b, a))]


def _merge_layer(flat: dict[str, Any], layer: Mapping[str, Any]) -> None:
    """``layer`` over ``flat`` (later wins), with the ``EITHER_OR`` rule: said once per derived null."""
    for mine, other in _either_or_pairs():
        if layer.get(mine) is not None and other not in layer and flat.get(other) is not None:
            logger.info("%s=null: %s=%r is set over it (exactly one of them applies)", other, mine, layer[mine])
            flat[other] = None
    for key, value in layer.items():
        flat.pop(key, None)
        flat[key] = value
