"""``job.environment`` name -> the function that builds that environment from the job config.

Place in the data flow: set-up of the main job (``job/main.py``: ``make_environment`` before any process group,
so a bad prompt file or reward function stops the run with one line). A new task registers a builder here (or
with ``register_environment`` from its own module, imported before the job starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_rl.config import ConfigError
from megatron_rl.environments.base import Environment

if TYPE_CHECKING:
    from megatron_rl.job.config import JobConfig

EnvironmentBuilder = Callable[..., Environment]
"""``builder(config, *, max_rows=None)``: ``max_rows`` (the pre-flight's quick look) reads only the first rows of
any data the environment has."""
ENVIRONMENTS: dict[str, EnvironmentBuilder] = {}


def register_environment(name: str, builder: EnvironmentBuilder) -> None:
    ENVIRONMENTS[name] = builder


def make_environment(config: JobConfig, *, max_rows: int | None = None) -> Environment:
    """The environment ``config.job.environment`` names; ConfigError listing the known ones otherwise.
    ``max_rows``: build it on the first rows of its data only (``job/preflight.py``)."""
    name = config.environment
    if name not in ENVIRONMENTS:
        raise ConfigError(f"job.environment={name!r} is not one of {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](config, max_rows=max_rows)


def _next_digit(config: JobConfig, *, max_rows: int | None = None) -> Environment:
    from megatron_rl.environments.next_digit.environment import NextDigitEnvironment

    return NextDigitEnvironment(config.next_digit, max_new_tokens=config.job.max_new_tokens)


def _single_turn(config: JobConfig, *, max_rows: int | None = None) -> Environment:
    from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment
    from megatron_rl.hf.config import model_config_from_hf
    from megatron_rl.hf.tokenizer import load_tokenizer

    hf_path = config.rl.model.hf_path
    assert hf_path is not None, "JobConfig checks that single_turn has model.hf_path"
    try:  # a folder that is not a supported checkpoint stops here, before any process group
        context = model_config_from_hf(hf_path, key="model.hf_path").max_position_embeddings
        tokenizer = load_tokenizer(hf_path, key="model.hf_path")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return SingleTurnEnvironment(config.data, config.reward, tokenizer, seed=config.rl.seed,
                                 max_prompt_tokens=prompt_limit(config, context), context=context, max_rows=max_rows)


def prompt_limit(config: JobConfig, context: int) -> int:
    """Longest prompt kept: ``data.max_prompt_tokens``, else the context minus ``job.max_new_tokens`` but at
    least half the context (responses are then capped by what the context leaves: ``SingleTurnEnvironment``)."""
    limit = config.data.max_prompt_tokens or max(context - config.job.max_new_tokens, context // 2)
    if limit >= context:
        raise ConfigError(f"data.max_prompt_tokens={limit} leaves no room for a response in the model's "
                          f"max_position_embeddings={context}; set data.max_prompt_tokens below {context}")
    return limit


register_environment("next_digit", _next_digit)
register_environment("single_turn", _single_turn)
