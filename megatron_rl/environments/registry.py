"""``job.environment`` -> the function that builds that environment from the job config.

Place in the data flow: set-up of the main job (``job/main.py``: ``make_environment`` before any process group,
so a bad prompt file, reward function or environment class stops the run with one line). Two kinds of names:

- a registered name (``next_digit``, ``single_turn``, or one a plug-in adds with ``register_environment`` from
  its own module, imported before the job starts);
- a user's step-API class, ``path/to/file.py:Class`` or ``package.module:Class`` (``step_api/``): no registration;
- ``agent``: what ``job.environment`` resolves to when ``job.agent`` names a user's OpenAI-client agent function
  (``agent/``).

Environments are plug-ins of the job: this module never imports the job's config. A builder is called with the
job's config (``megatron_rl/job/config.py: JobConfig``) and reads the sections it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.environments.base import Environment

EnvironmentBuilder = Callable[..., Environment]
"""``builder(config, *, max_rows=None)``: job config (``JobConfig``) -> environment; may raise ``ConfigError``
(before any process group). ``max_rows`` (the pre-flight's quick look, ``job/preflight.py``): read only the
first rows of any data the environment has."""
ENVIRONMENTS: dict[str, EnvironmentBuilder] = {}


def register_environment(name: str, builder: EnvironmentBuilder) -> None:
    """Make ``job.environment=<name>`` build with ``builder``; ValueError for a name taken or one with a ':'."""
    if name in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is already registered; pick another name "
                         f"(registered: {sorted(ENVIRONMENTS)})")
    if is_class_spec(name):
        raise ValueError(f"environment name {name!r} has a ':', which job.environment reads as file.py:Class")
    ENVIRONMENTS[name] = builder


def is_class_spec(name: str) -> bool:
    """``job.environment`` names a user's step-API class (``file.py:Class`` or ``module:Class``)."""
    return ":" in name


def known_environments() -> list[str]:
    return sorted(ENVIRONMENTS)


def make_environment(config: Any, *, max_rows: int | None = None) -> Environment:
    """The environment ``config.environment`` names; ConfigError listing the known ones otherwise. ``max_rows``:
    build it on the first rows of its data only (``job/preflight.py``)."""
    name = config.environment
    if is_class_spec(name):
        return _step_api(config, max_rows=max_rows)
    if name not in ENVIRONMENTS:
        raise ConfigError(f"job.environment={name!r} is not one of {known_environments()} nor a step-API class "
                          "(path/to/file.py:Class or package.module:Class)")
    return ENVIRONMENTS[name](config, max_rows=max_rows)


def _next_digit(config: Any, *, max_rows: int | None = None) -> Environment:
    from megatron_rl.environments.next_digit.environment import NextDigitEnvironment

    return NextDigitEnvironment(config.next_digit, max_new_tokens=config.job.max_new_tokens)


def _tokenizer_and_context(config: Any) -> tuple[Any, int]:
    """The tokenizer of ``model.hf_path`` and the model's context (``max_position_embeddings`` of the job's
    resolved model section, ``job/config.py: with_checkpoint_model``); errors name ``model.hf_path``."""
    from megatron_rl.hf.config import config_json
    from megatron_rl.hf.tokenizer import load_tokenizer

    hf_path = config.rl.model.hf_path
    assert hf_path is not None, "JobConfig checks that this environment has model.hf_path"
    try:  # a folder that is not a checkpoint stops here, before any process group
        config_json(hf_path, key="model.hf_path")
        tokenizer = load_tokenizer(hf_path, key="model.hf_path")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return tokenizer, config.rl.model.max_position_embeddings


def prompt_limit(config: Any, context: int) -> int:
    """Longest prompt kept: ``data.max_prompt_tokens``, else the context minus ``job.max_new_tokens`` but at
    least half the context (responses are then capped by what the context leaves: ``SingleTurnEnvironment``)."""
    limit = config.data.max_prompt_tokens or max(context - config.job.max_new_tokens, context // 2)
    if limit >= context:
        raise ConfigError(f"data.max_prompt_tokens={limit} leaves no room for a response in the model's "
                          f"max_position_embeddings={context}; set data.max_prompt_tokens below {context}")
    return limit


def _single_turn(config: Any, *, max_rows: int | None = None) -> Environment:
    from megatron_rl.distillation.routing import router
    from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment

    tokenizer, context = _tokenizer_and_context(config)
    distillation = config.rl.distillation
    environment = SingleTurnEnvironment(config.data, config.reward, tokenizer, seed=config.rl.seed,
                                        max_prompt_tokens=prompt_limit(config, context), context=context,
                                        max_rows=max_rows, teacher_of=router(distillation),
                                        images=_prompt_images(config))
    check_rows_routing(config, [p.extra for p in environment.train.kept])
    return environment


def _prompt_images(config: Any) -> Any:
    """``data.image_key``'s image encoder (None when unset); ConfigError for an engine that cannot take images."""
    if config.data.image_key is None:
        return None
    from megatron_rl.environments.single_turn.images import PromptImages

    if config.rollout.engine not in ("builtin", "vllm"):
        raise ConfigError(f"data.image_key={config.data.image_key!r} needs rollout.engine=builtin or vllm (got "
                          f"{config.rollout.engine!r}): the engines that take images (docs/VISION.md)")
    images = PromptImages(config.data.image_key, config.rl.model.hf_path,  # ConfigError for a text checkpoint
                          base_dirs=image_dirs(config))
    if config.rollout.engine == "vllm":
        from megatron_rl.hf.families import family_of

        family = family_of(config.rl.model)
        if not family.support.vllm_images:
            raise ConfigError(f"data.image_key={config.data.image_key!r} with rollout.engine=vllm: vLLM with "
                              f"images is not wired for {family.title or family.name} models yet; use "
                              "rollout.engine=builtin (docs/VISION.md section 12)")
    return images


def _turn_images(config: Any) -> Any:
    """The image encoder of a multi-turn environment (``turn_images.py``): ``data.image_key``'s (checked as for
    ``single_turn``), else one for any vision-language ``model.hf_path`` whose engine takes images; None otherwise
    (text only: a step-API class that returns images is then refused at start-up)."""
    from megatron_rl.environments.turn_images import TurnImages

    if config.data.image_key is not None:
        prompt = _prompt_images(config)
        return TurnImages.from_checkpoint(config.rl.model.hf_path, prompt.base_dirs, config.data.image_key,
                                          encoder=prompt.encoder)
    from megatron_rl.environments.single_turn.images import is_vision_checkpoint

    hf_path = config.rl.model.hf_path
    if config.rollout.engine not in ("builtin", "vllm") or not is_vision_checkpoint(hf_path):
        return None
    if config.rollout.engine == "vllm":
        from megatron_rl.hf.families import family_of

        if not family_of(config.rl.model).support.vllm_images:
            return None
    return TurnImages.from_checkpoint(hf_path, image_dirs(config))


def image_dirs(config: Any) -> list[str]:
    """Where a relative image path is looked for, in order: the directory the command runs from
    (``$MEGATRON_RL_CALLER_CWD``, which ``run_megatron.sh`` sets before it changes into the repository: the job's
    ``job/paths.py: caller_cwd``), then each data file's folder."""
    import os
    from pathlib import Path

    files = config.data.paths("train_files") + config.data.paths("val_files")
    return [os.environ.get("MEGATRON_RL_CALLER_CWD") or ".", *dict.fromkeys(str(Path(f).parent) for f in files)]


def turn_prompt_limit(config: Any, context: int) -> int:
    """The longest prompt of one turn (a step-API turn, an agent's call): ``data.max_prompt_tokens``, else the
    context minus ``job.max_new_tokens`` (each reply is capped by ``job.max_new_tokens``)."""
    limit = config.data.max_prompt_tokens or context - config.job.max_new_tokens
    if limit < 1 or limit + config.job.max_new_tokens > context:
        raise ConfigError(f"data.max_prompt_tokens={limit} + job.max_new_tokens={config.job.max_new_tokens} exceeds "
                          f"the model's max_position_embeddings={context}; lower one of them")
    return limit


def _step_api(config: Any, *, max_rows: int | None = None) -> Environment:
    """A step-API class (its turns are capped by ``job.max_new_tokens`` and ``turn_prompt_limit``)."""
    from megatron_rl.environments.step_api.environment import StepApiEnvironment

    from megatron_rl.distillation.routing import router

    tokenizer, context = _tokenizer_and_context(config)
    environment = StepApiEnvironment(config.environment, config.data, tokenizer, seed=config.rl.seed,
                                     max_turns=config.job.max_turns,
                                     max_prompt_tokens=turn_prompt_limit(config, context),
                                     episode_timeout_s=config.job.episode_timeout_s,
                                     teacher_of=router(config.rl.distillation), images=_turn_images(config))
    check_rows_routing(config, environment.train)
    return environment


def _agent(config: Any, *, max_rows: int | None = None) -> Environment:
    """A user's OpenAI-client agent (``job.agent``; each call capped as a step-API turn)."""
    from megatron_rl.environments.agent.environment import AgentEnvironment

    from megatron_rl.distillation.routing import router

    if config.data.image_key is not None:
        raise ConfigError(f"data.image_key={config.data.image_key!r} with job.agent={config.job.agent!r}: an agent "
                          "sends its images itself, as image_url parts of its messages (docs/VISION.md section 14); "
                          "unset data.image_key")
    tokenizer, context = _tokenizer_and_context(config)
    environment = AgentEnvironment(config.job.agent, config.data, tokenizer, seed=config.rl.seed,
                                   max_concurrency=config.job.max_concurrency,
                                   max_prompt_tokens=turn_prompt_limit(config, context),
                                   tool_call_parser_name=config.rollout.tool_call_parser, max_rows=max_rows,
                                   episode_timeout_s=config.job.episode_timeout_s,
                                   teacher_of=router(config.rl.distillation), images=_turn_images(config))
    check_rows_routing(config, environment.train)
    return environment


def check_rows_routing(config: Any, rows: Any) -> None:
    """Teachers routed by ``when``: every training row read once (a ``when`` column no row has, a row two teachers
    match: ConfigError naming the teacher's key)."""
    from megatron_rl.distillation.routing import check_routing

    if config.rl.distillation.routed:
        check_routing(config.rl.distillation, rows, "data.train_files")


register_environment("next_digit", _next_digit)
register_environment("single_turn", _single_turn)
register_environment("agent", _agent)
