"""The user's reward function: found from ``reward.function``, checked once, called per response.

Place in the data flow: set-up (``load_reward_function``, ``check_reward_function`` on one row, before any
collective) and every rollout of the ``single_turn`` environment (``score``).

The function is called as ``fn(prompt=<text>, response=<text>, **other_columns)`` and returns a number, or a
dict with ``reward`` (a number) and other numbers (logged as ``reward_fn/<key>``). Anything else is the user's
mistake: a ``ConfigError`` naming ``reward.function`` and what it returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.environments.user_code import load_object

RewardFn = Callable[..., Any]
KEY = "reward.function"


def load_reward_function(spec: str | None) -> RewardFn:
    """``path/file.py:name`` or ``package.module:name`` -> the callable; ConfigError naming what is missing
    (``user_code.load_object``)."""
    fn = load_object(spec, KEY, "function")
    if not callable(fn):
        raise ConfigError(f"{KEY}={spec!r} names {fn!r} ({type(fn).__name__}), not a function")
    return fn


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
        return _number(value.item())
    return None


def normalize(result: Any, spec: str) -> tuple[float, dict[str, float]]:
    """``(reward, metrics)`` of one call's return value; ConfigError for anything but a finite number or a dict
    with a finite number under ``reward`` (other values must be numbers too)."""
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise ConfigError(f"reward.function={spec!r} returned a dict without 'reward' (keys {sorted(result)})")
        metrics = {}
        for key, value in result.items():
            number = _number(value)
            if number is None:
                raise ConfigError(f"reward.function={spec!r} returned {key}={value!r}: every value must be a "
                                  "finite number")
            metrics[str(key)] = number
        return metrics.pop("reward"), metrics
    number = _number(result)
    if number is None:
        raise ConfigError(f"reward.function={spec!r} returned {result!r} ({type(result).__name__}); it must return "
                          "a finite number or a dict with 'reward'")
    return number, {}


def score(fn: RewardFn, spec: str, *, prompt: str, response: str, extra: Mapping[str, Any]
          ) -> tuple[float, dict[str, float]]:
    """One call, normalized."""
    return normalize(fn(prompt=prompt, response=response, **extra), spec)


def check_reward_function(fn: RewardFn, spec: str, *, prompt: str, extra: Mapping[str, Any]) -> None:
    """Call ``fn`` once on a real row (with an empty response) at start-up: a missing parameter, an exception or
    a non-number return value becomes a ConfigError naming the function, before any process group exists."""
    try:
        result = fn(prompt=prompt, response="", **extra)
    except Exception as err:
        raise ConfigError(f"reward.function={spec!r} raised {type(err).__name__}: {err} when called on the first "
                          f"training row as fn(prompt=..., response='', {', '.join(f'{k}=...' for k in extra)}); "
                          "it must accept these keyword arguments and return a number") from err
    normalize(result, spec)
