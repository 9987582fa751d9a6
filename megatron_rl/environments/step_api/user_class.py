"""The user's step-API class: found and checked at start-up, then called per episode with its returns checked.

Place in the data flow: set-up (``UserClass(spec)``, ``check_on_row`` on the first training row, before any process
group) and every turn of every episode of a step-API environment (``environment.py``). The interface::

    class MyEnv:
        def __init__(self, **row): ...          # one episode: the data row's columns as keyword arguments
        def reset(self): ...                    # -> the first messages: a list of chat messages, or a string
        def step(self, response): ...           # -> (observation, reward, done), or a dict with those keys

``response`` is the text of the model's reply (special tokens skipped). ``observation``: the messages appended
after the reply (roles ``user`` or ``tool``), a string (a user message; raw text when the tokenizer has no chat
template), or None when ``done``. ``reward``: a finite number (the episode's reward is the sum over its turns).

Images (a vision-language checkpoint; docs/VISION.md section 14): ``reset()`` may return ``(first, images)`` and
``step`` ``(observation, reward, done, images)`` (or the dict's ``images``): a list of images (PIL images, paths,
bytes, ``data:`` URLs), one per image placeholder of that text, in order. The first prompt's images are the data
row's ``data.image_key`` column's, then those ``reset`` returns.

A mistake in the class is one line naming the class and the call: a ``ConfigError`` at start-up (a missing
method, a constructor, ``reset`` or ``step`` that raises or returns the wrong shape on the first row), an
``EpisodeError`` during the run (``environment.py`` counts the episode as failed and leaves it out).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.data.images import ImageError
from megatron_rl.environments.conversation import Conversation, Message, as_messages
from megatron_rl.environments.turn_images import TurnImages
from megatron_rl.environments.user_code import load_object

KEY = "job.environment"
OBSERVATION_ROLES = ("user", "tool")
"""Roles an observation's messages may have (they follow the assistant's reply)."""


class EpisodeError(Exception):
    """One episode's call into the user's class raised or returned the wrong shape (a one-line message)."""


@dataclass
class StepResult:
    observation: str | list[Message] | None
    reward: float
    done: bool
    images: list[Any] = field(default_factory=list)
    """The observation's images, in order (docstring above)."""


class UserClass:
    """The class ``job.environment`` names, with checked calls."""

    def __init__(self, spec: str) -> None:
        cls = load_object(spec, KEY, "class")
        if not inspect.isclass(cls):
            raise ConfigError(f"{KEY}={spec!r} names a {type(cls).__name__}, not a class with reset() and "
                              "step(response)")
        for method, signature in (("reset", "reset()"), ("step", "step(response)")):
            if not callable(getattr(cls, method, None)):
                raise ConfigError(f"{KEY}={spec!r}: class {cls.__name__} has no method {signature}; a step-API "
                                  "environment defines __init__(**row), reset() and step(response) (docs/JOB.md)")
        self.cls, self.spec, self.name = cls, spec, cls.__name__

    def new(self, row: Mapping[str, Any]) -> Any:
        """``Class(**row)``: one episode."""
        return self._call(f"{self.name}(**row)", self.cls, **row)

    def reset(self, env: Any) -> tuple[str | list[Message], list[Any]]:
        """The first messages (or string) and their images."""
        first = self._call(f"{self.name}.reset()", env.reset)
        where = f"{self.name}.reset() returned {_shown(first)}"
        images: list[Any] = []
        if isinstance(first, tuple) and len(first) == 2:
            first, images = first[0], _images(first[1], where)
        if isinstance(first, str):
            return first, images
        try:
            return as_messages(first), images
        except ValueError as err:
            raise EpisodeError(f"{where}: it must return a string or a list of chat messages, or (that, images) "
                               f"({err})") from None

    def step(self, env: Any, response: str) -> StepResult:
        result = self._call(f"{self.name}.step(response)", env.step, response)
        where = f"{self.name}.step(response) returned {_shown(result)}"
        if isinstance(result, Mapping):
            missing = {"reward", "done"} - set(result)
            if missing:
                raise EpisodeError(f"{where}: a dict needs the keys observation, reward and done (missing "
                                   f"{sorted(missing)})")
            result = (result.get("observation"), result["reward"], result["done"], result.get("images") or [])
        if not isinstance(result, (tuple, list)) or len(result) not in (3, 4):
            raise EpisodeError(f"{where}: it must return (observation, reward, done), (observation, reward, done, "
                               "images) or a dict with those keys")
        observation, reward, done, images = (*result, [])[:4]
        checked = StepResult(self._observation(observation, where), self._reward(reward, where),
                             self._done(done, where), _images(images, where))
        if checked.observation is None and not checked.done:
            raise EpisodeError(f"{where}: the observation is None but done is False; return the next observation, "
                               "or done=True")
        return checked

    def check_on_row(self, row: Mapping[str, Any], tokenizer: Any, what: str, images: TurnImages | None = None
                     ) -> None:
        """Construct, reset, render and step once (``response=''``) on ``row`` (``what`` names it): every mistake
        a ConfigError naming the class and the call. ``images``: the image encoder (None: text only; images
        returned are then a ConfigError); an image that cannot be read is no mistake of the class here (a failed
        episode during the run, counted)."""
        try:
            env = self.new(row)
            first, first_images = self.reset(env)
            row_images = images.row_images(dict(row)) if images is not None else []
            Conversation(tokenizer, first, images=images, first_images=[*row_images, *first_images])
            result = self.step(env, "")
            if result.observation is not None and not result.done:
                conversation = Conversation(tokenizer, "", images=images)
                conversation.add_response([], [], "stop")
                try:
                    conversation.add_observation(result.observation, result.images)
                except ValueError as err:
                    if isinstance(err, ImageError):
                        raise
                    raise EpisodeError(f"{self.name}.step(response) returned an observation that cannot be "
                                       f"rendered: {err}") from err
        except ImageError:
            return
        except (EpisodeError, ValueError) as err:
            raise ConfigError(f"{KEY}={self.spec!r}: {err} (checked at start-up: {self.name}(**row), reset() and "
                              f"step('') on {what}, whose columns are {sorted(row)})") from err

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise EpisodeError(f"{what} raised {type(err).__name__}: {err}") from err

    def _observation(self, value: Any, where: str) -> str | list[Message] | None:
        if value is None or isinstance(value, str):
            return value
        try:
            return as_messages(value, OBSERVATION_ROLES)
        except ValueError as err:
            raise EpisodeError(f"{where}: the observation must be a string, a list of messages (roles "
                               f"{' or '.join(OBSERVATION_ROLES)}) or None ({err})") from None

    def _reward(self, value: Any, where: str) -> float:
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
            value = value.item()
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            return float(value)
        raise EpisodeError(f"{where}: the reward must be a finite number, got {_shown(value)}")

    def _done(self, value: Any, where: str) -> bool:
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if isinstance(value, (bool, int)):
            return bool(value)
        raise EpisodeError(f"{where}: done must be a bool, got {_shown(value)}")


def _images(value: Any, where: str) -> list[Any]:
    """A returned image list (one image alone: a list of it); EpisodeError for anything else."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray)) or hasattr(value, "convert"):  # a path / URL / bytes / PIL image
        return [value]
    raise EpisodeError(f"{where}: images must be a list of images (PIL images, paths, bytes or data: URLs), got "
                       f"{_shown(value)}")


def _shown(value: Any) -> str:
    return f"{str(value)[:80]!r} ({type(value).__name__})"
