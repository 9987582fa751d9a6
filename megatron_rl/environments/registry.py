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

EnvironmentBuilder = Callable[["JobConfig"], Environment]
ENVIRONMENTS: dict[str, EnvironmentBuilder] = {}


def register_environment(name: str, builder: EnvironmentBuilder) -> None:
    ENVIRONMENTS[name] = builder


def make_environment(config: JobConfig) -> Environment:
    """The environment ``config.job.environment`` names; ConfigError listing the known ones otherwise."""
    name = config.environment
    if name not in ENVIRONMENTS:
        raise ConfigError(f"job.environment={name!r} is not one of {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](config)


def _next_digit(config: JobConfig) -> Environment:
    from megatron_rl.environments.next_digit.environment import NextDigitEnvironment

    return NextDigitEnvironment(config.next_digit, max_new_tokens=config.job.max_new_tokens)


def _single_turn(config: JobConfig) -> Environment:
    from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment
    from megatron_rl.hf.config import model_config_from_hf
    from megatron_rl.hf.tokenizer import load_tokenizer

    hf_path = config.rl.model.hf_path
    assert hf_path is not None, "JobConfig checks that single_turn has model.hf_path"
    try:  # a folder that is not a supported checkpoint stops here, before any process group
        context = model_config_from_hf(hf_path).max_position_embeddings
        tokenizer = load_tokenizer(hf_path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    limit = config.data.max_prompt_tokens or context - config.job.max_new_tokens
    if limit < 1 or limit + config.job.max_new_tokens > context:
        raise ConfigError(f"data.max_prompt_tokens={limit} + job.max_new_tokens={config.job.max_new_tokens} exceeds "
                          f"the model's max_position_embeddings={context}; lower one of them")
    return SingleTurnEnvironment(config.data, config.reward, tokenizer, seed=config.rl.seed, max_prompt_tokens=limit)


register_environment("next_digit", _next_digit)
register_environment("single_turn", _single_turn)
