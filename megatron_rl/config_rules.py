"""The validation framework of the config sections (``config.py``): valid ranges declared next to each field
(``field(..., metadata=valid(...))``), ``Literal`` choices, and ``ConfigSection``, whose ``__post_init__`` checks
the fields it owns and then its own rules between them (``_check_rules``). Every user mistake raises
``ConfigError`` (a ``ValueError``) naming the dotted key, the value and the valid range or fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Literal

from megatron_rl.config_files import ConfigError

# --------------------------------------------------------------------------------------------------------------
# Valid ranges, declared next to the fields
# --------------------------------------------------------------------------------------------------------------


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


@dataclass(frozen=True)
class Interval:
    """The valid values of a numeric field: finite numbers between ``low`` and ``high`` (open or closed ends)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            if self.low == -math.inf:
                return "finite"
            return f"finite and {'>' if self.low_open else '>='} {_number(self.low)}"
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def valid(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,
          high_open: bool = False) -> dict[str, Interval]:
    """Field metadata declaring the valid range (``None`` is always allowed where the type allows it)."""
    return {"valid": Interval(low, high, low_open, high_open)}


AT_LEAST_1 = valid(1)
NON_NEGATIVE = valid(0)
POSITIVE = valid(0, low_open=True)
FINITE = valid()
UNIT = valid(0, 1)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: object, prefix: str) -> None:
    """Each field of the dataclass ``obj`` against its declared range and its ``Literal`` choices."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        interval = f.metadata.get("valid")
        hint = hints[f.name]
        words = _literal_words(hint)
        if interval is not None and value is not None and value not in interval and value not in words:
            raise ConfigError(f"{key}={value!r} is out of range; it must be {interval}"
                              + "".join(f" or {w!r}" for w in words))
        if typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            raise ConfigError(f"{key}={value!r} is not one of {list(typing.get_args(hint))}")


def _literal_words(hint: Any) -> tuple:
    """The ``Literal`` choices inside a union such as ``int | Literal["auto"] | None`` (``()`` for others)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return ()
    return tuple(w for option in typing.get_args(hint) if typing.get_origin(option) is Literal
                 for w in typing.get_args(option))


class ConfigSection:
    """Base of a config section: validates the fields it owns once, on construction.

    Subclasses are ``@dataclass(kw_only=True)`` with ``SECTION`` (the YAML key of the section) and may add
    ``_check_rules`` for rules between their own fields.
    """

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Ranges and choices of every field, then the section's rules; ConfigError names the dotted key."""
        check_fields(self, f"{self.SECTION}.")
        self._check_rules()

    def _check_rules(self) -> None:
        """Rules between this section's fields (none by default)."""


@contextlib.contextmanager
def reported_as_config_error() -> Iterator[None]:
    """The algorithms' and data's validators raise plain ValueError (they cannot import ConfigError): re-raise."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def on_cpu(device: str) -> bool:
    """Whether ``parallel.device`` (or a torch device type) means CPU here ('auto': no CUDA device)."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
