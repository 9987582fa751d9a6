"""The main job's configuration: the library's ``MegatronRLConfig`` plus the job's own sections.

Place in the data flow: read once by the main job (``job/main.py``) and its pre-flight before anything else.
Every section comes from the same YAML file and the same dotted overrides (``optimizer.lr=1e-3
job.num_steps=20``): the library's sections at the top level, and

    job:         how long, which environment, how to sample (n per prompt, temperature, top_p, max new tokens)
    next_digit:  the digit game's rules (environment next_digit, the default)
    data:        prompt files (environment single_turn)           reward:  the reward function (single_turn)
    eval:        periodic evaluation on held-out prompts          export:  HF exports of the policy
    rollout:     which engine generates (megatron_rl/inference/config.py)
    launch:      where the launchers start: here or Slurm (job/launch_config.py, megatron_rl/launch/)

The library never sees these sections. Keys that moved keep working (``MOVED_KEYS``: the demo's ``demo.*`` keys
and ``batch.n_samples_per_prompt``). Validation follows ``megatron_rl.config``: each section checks its fields on
construction, ``JobConfig`` the rules between sections (``check_job_config``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

from megatron_rl.config import (
    AT_LEAST_1,
    FINITE,
    KEY_ALIASES,
    NON_NEGATIVE,
    POSITIVE,
    ConfigError,
    ConfigSection,
    MegatronRLConfig,
    Schema,
    build_config,
    check_keys,
    config_to_dict,
    read_overrides,
    valid,
    write_yaml,
)
from megatron_rl.environments.next_digit.config import NextDigitConfig
from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer
from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.registry import check_engine_config, engine_entry
from megatron_rl.job.implied import with_implied
from megatron_rl.job.launch_config import LaunchConfig
from megatron_rl.job.paths import BASE_KEY, resolve_path_keys


@dataclass(kw_only=True)
class JobSection(ConfigSection):
    """The RL loop of the main job (``job/main.py``): how long, on which environment, how to sample."""

    SECTION: ClassVar[str] = "job"

    num_steps: int = field(default=150, metadata=AT_LEAST_1)
    """RL train steps (one batch of fresh rollouts each; ``batch.train_batch_size`` prompts per step)."""
    environment: str = "auto"
    """The task (``megatron_rl/environments/registry.py``): 'next_digit' (the toy multi-turn game),
    'single_turn' (``data.train_files`` + ``reward.function``, which pure distillation may leave unset; needs
    ``model.hf_path``), 'auto': single_turn when ``data.train_files`` is set, else next_digit; or a step-API
    class, ``path/to/file.py:Class`` or ``package.module:Class`` (``Class(**row)`` per episode, ``reset()``,
    ``step(response)``: docs/JOB.md; needs ``model.hf_path`` and ``data.train_files``; implies step-wise training
    with merging, ``job/implied.py``)."""
    agent: str | None = None
    """A user's OpenAI-client agent, ``path/to/file.py:function`` or ``package.module:function``: called once per
    episode as ``function(base_url=<an OpenAI-compatible /v1 URL the job serves for that episode>, **row)`` and
    returns the episode's reward (a number, or a dict with ``reward``); its chat.completions calls are sampled on
    the vLLM fleet and trained token-exact (docs/JOB.md, ``environments/agent/``). Leave ``job.environment`` at
    'auto'; needs ``model.hf_path`` (a tokenizer with a chat template), ``data.train_files`` (one row per GRPO
    group of ``n_samples_per_prompt`` episodes); implies ``rollout.engine=vllm`` and step-wise training with merging
    (``job/implied.py``)."""
    max_concurrency: int = field(default=32, metadata=AT_LEAST_1)
    """Episodes of ``job.agent`` running at once (threads on global rank 0; each waits on the fleet for its
    calls)."""
    episode_timeout_s: float = field(default=900.0, metadata=POSITIVE)
    """Seconds one episode may spend in your code: a ``job.agent`` function (its tool calls included; time waiting
    for a replacement engine not counted), or the calls into a step-API class (``job.environment``; the engine's
    replies not counted). Past it the episode is given up, counted as a failed sample (``rollout/failed_samples``,
    one line naming the row and the limit) and the step goes on; while a step waits on episodes running over a
    minute, a line every minute names them. 900 s fits tool calls to real services; lower it for fast tools, raise
    it for slow ones."""
    max_turns: int = field(default=8, metadata=AT_LEAST_1)
    """Turns per episode at most (a step-API environment): an episode not done after this many replies ends,
    counted in ``episode/ended_max_turns``."""
    n_samples_per_prompt: int = field(default=4, metadata=AT_LEAST_1)
    """Responses per prompt (the GRPO group size); old spellings demo.n_samples_per_prompt,
    batch.n_samples_per_prompt."""
    max_new_tokens: int = field(default=3, metadata=AT_LEAST_1)
    """Response length cap per turn (the digit game's right answer takes 2 tokens: digit and stop token)."""
    temperature: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Sampling temperature (0 = greedy); 1.0 makes rollout and trainer log-probs comparable (mismatch ~0)."""
    top_p: float = field(default=1.0, metadata=valid(0, 1, low_open=True))
    """Nucleus sampling mass (1.0 = off). Responses stop at the tokenizer's eos token."""


@dataclass(kw_only=True)
class EvalConfig(ConfigSection):
    """Periodic evaluation: one response per held-out prompt (``data.val_files``; the digit game: fixed games)."""

    SECTION: ClassVar[str] = "eval"

    interval: int = field(default=0, metadata=NON_NEGATIVE)
    """RL steps between evaluations (0 = never); the last step is always evaluated when > 0. Logged as
    ``eval/reward_mean`` and ``eval/pass_rate`` (metrics.jsonl, TensorBoard, the final plot)."""
    temperature: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Sampling temperature of evaluation (0 = greedy)."""
    max_new_tokens: int | None = field(default=None, metadata=AT_LEAST_1)
    """Response length cap of evaluation; None = ``job.max_new_tokens``."""
    num_prompts: int | None = field(default=None, metadata=AT_LEAST_1)
    """Held-out prompts per evaluation (the first ones); None = all (the digit game: ``next_digit.eval_games``)."""
    pass_threshold: float = field(default=1.0, metadata=FINITE)
    """A response passes when its reward >= this; ``eval/pass_rate`` is the share that passes."""


@dataclass(kw_only=True)
class ExportConfig(ConfigSection):
    """Hugging Face exports of the policy (needs ``model.hf_path``: its config and tokenizer are copied)."""

    SECTION: ClassVar[str] = "export"

    interval: int = field(default=0, metadata=NON_NEGATIVE)
    """RL steps between exports (0 = only after the last step); each one is ``<dir>/step_<N>``, loadable with
    ``transformers.AutoModelForCausalLM.from_pretrained``."""
    dir: str | None = None
    """Where the exports go; None = ``hf/`` beside the checkpoint directory (``<logging.output_dir>/hf``)."""
    enabled: bool = True
    """Export at all (only when ``model.hf_path`` is set: a model trained from scratch has no HF config)."""


@dataclass(kw_only=True)
class JobConfig:
    """What the main job runs with: the library config (``rl``) and the job's sections."""

    rl: MegatronRLConfig
    """Everything the library reads (parallel, model, optimizer, algorithm, batch, ..., seed)."""
    job: JobSection = field(default_factory=JobSection)
    """The loop: steps, environment, sampling (YAML section ``job``)."""
    next_digit: NextDigitConfig = field(default_factory=NextDigitConfig)
    """The digit game's rules (read when the environment is next_digit)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files (single_turn)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function (single_turn)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation on held-out prompts."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Hugging Face exports of the policy (with model.hf_path)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Which engine generates the rollouts (``megatron_rl/inference/config.py``)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Where the launchers start: this machine or Slurm (``job/launch_config.py``; read by ``megatron_rl/launch``
    before the ranks start, not by them)."""

    SECTIONS: ClassVar[tuple[str, ...]] = ("job", "next_digit", "data", "reward", "eval", "export", "rollout",
                                           "launch")

    def __post_init__(self) -> None:
        check_job_config(self)
        check_engine_config(self.rollout, self.rl.model, self.rl.parallel.device)  # by the engine's capabilities

    @property
    def environment(self) -> str:
        """``job.environment`` with 'auto' resolved ('agent' when ``job.agent`` is set)."""
        if self.job.agent and self.job.environment == "auto":
            return "agent"
        if self.job.environment != "auto":
            return self.job.environment
        return "single_turn" if self.data.train_files else "next_digit"

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout: the library's sections, then the job's (``load_job_config`` reads it back)."""
        return {**config_to_dict(self.rl), **{name: dataclasses.asdict(getattr(self, name)) for name in self.SECTIONS}}

    @property
    def optim_steps_per_rl_step(self) -> int:
        batch = self.rl.batch
        return batch.train_batch_size // batch.policy_mini_batch_size * batch.update_epochs_per_batch

    @property
    def save_dir(self) -> Path:
        """``checkpoint.save_dir``, else ``<logging.output_dir>/checkpoints`` (``megatron_rl.preflight:
        checkpoint_dir``, the one rule)."""
        from megatron_rl.preflight import checkpoint_dir

        return checkpoint_dir(self.rl)

    @property
    def export_dir(self) -> Path:
        """``export.dir``, else ``hf/`` beside the checkpoint directory."""
        return Path(self.export.dir) if self.export.dir else self.save_dir.parent / "hf"


def check_demo_config(config: MegatronRLConfig, tokenizer: DigitTokenizer) -> None:
    """The digit game's rules on the library config: its own 16-token vocabulary, a model trained from scratch."""
    if config.model.vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} but the demo tokenizer has {tokenizer.vocab_size} tokens; "
            f"set model.vocab_size={tokenizer.vocab_size} (configs/demo_cpu.yaml does)"
        )
    if config.model.hf_path is not None:
        raise ConfigError(f"model.hf_path={config.model.hf_path!r}: the demo trains a model from scratch on its "
                          "own 16-token vocabulary; unset model.hf_path (or set job.environment=single_turn)")


def check_job_config(config: JobConfig) -> None:
    """Rules between sections: what each environment needs, and settings that would have no effect."""
    from megatron_rl.environments.registry import ENVIRONMENTS, is_class_spec

    env = config.environment
    if config.job.agent or env == "agent":
        check_agent_config(config)
    elif is_class_spec(env):
        check_step_api_config(config)
    elif env not in ENVIRONMENTS:
        raise ConfigError(f"job.environment={env!r} is not one of {['auto', *sorted(ENVIRONMENTS)]} nor a "
                          "step-API class (path/to/file.py:Class or package.module:Class)")
    if env == "next_digit":
        check_demo_config(config.rl, DigitTokenizer())
        check_rollout_shapes(config)
    elif env == "single_turn":
        distilling = config.rl.distillation.enabled and config.rl.distillation.coef > 0  # pure distillation: no reward
        for key, value in (("model.hf_path", config.rl.model.hf_path), ("data.train_files", config.data.train_files),
                           ("reward.function", config.reward.function or distilling)):
            if not value:
                alone = (" or distil from a teacher without one (docs/DISTILLATION.md)" if key == "reward.function"
                         else "")
                raise ConfigError(f"job.environment=single_turn needs {key}; set it (README: 'Your model, your "
                                  f"prompts, your reward'){alone}")
    if env not in ("single_turn", "agent") and not is_class_spec(env):
        check_no_routing(config)
    check_warmup(config)
    reads_rows = env in ("single_turn", "agent") or is_class_spec(env)
    if config.eval.interval > 0 and reads_rows and not config.data.val_files:
        raise ConfigError(f"eval.interval={config.eval.interval} but data.val_files is not set; set it to a "
                          "held-out prompt file, or eval.interval=0")


def check_no_routing(config: JobConfig) -> None:
    """Teachers routed by a data column (``distillation.teachers[i].when``) need rows with data columns: the
    ``single_turn`` environment's prompt rows, a step-API class's and an agent's data rows have them (the built-in
    ``next_digit`` game and a registered environment do not)."""
    for i, teacher in enumerate(config.rl.distillation.teachers):
        if teacher.when is not None:
            raise ConfigError(f"distillation.teachers[{i}].when={teacher.when!r}: job.environment="
                              f"{config.environment!r} gives its rows no data columns to route by (single_turn, "
                              "a step-API class and an agent have them: data.train_files); remove 'when' (one "
                              "teacher scores every row)")


def check_warmup(config: JobConfig) -> None:
    """``optimizer.lr_warmup_steps`` below the LR horizon (``optimizer.lr_decay_steps``, else the run's optimizer
    steps): the rule ``model/optimizer.py: build_scheduler`` applies in every rank, found at load (the pre-flight)."""
    opt = config.rl.optimizer
    total = config.job.num_steps * config.optim_steps_per_rl_step
    horizon = opt.lr_decay_steps if opt.lr_decay_steps is not None else total
    if opt.lr_warmup_steps >= horizon:
        what = (f"optimizer.lr_decay_steps={horizon}" if opt.lr_decay_steps is not None else
                f"the run's {total} optimizer steps (job.num_steps={config.job.num_steps} x "
                f"{config.optim_steps_per_rl_step} per RL step)")
        raise ConfigError(f"optimizer.lr_warmup_steps={opt.lr_warmup_steps} is not below {what}: the learning rate "
                          "would never reach optimizer.lr; lower the warm-up (0 = none) or raise job.num_steps")


def check_step_api_config(config: JobConfig) -> None:
    """A step-API class (``job.environment=<file.py>:<Class>``) needs a tokenizer, rows, and step-wise training
    (a conversation whose template rewrites history is several sequences)."""
    env = config.job.environment
    for key, value in (("model.hf_path", config.rl.model.hf_path), ("data.train_files", config.data.train_files)):
        if not value:
            raise ConfigError(f"job.environment={env!r} (a step-API environment) needs {key}; set it (docs/JOB.md)")
    if not config.rl.stepwise.step_wise_trajectories:
        raise ConfigError(f"job.environment={env!r} (a step-API environment) trains step-wise, one step per turn: "
                          "stepwise.step_wise_trajectories=false is the one value it cannot take; remove it (true "
                          "is implied)")


def check_agent_config(config: JobConfig) -> None:
    """An agent (``job.agent=<file.py>:<function>``) needs a tokenizer, rows, step-wise training and the vLLM fleet
    (its calls are single requests on rank 0's fleet), and a tool-call parser that exists."""
    from megatron_rl.environments.agent.tool_parsers import TOOL_CALL_PARSERS

    agent = config.job.agent
    if not agent:
        raise ConfigError("job.environment=agent needs job.agent=<path/to/file.py>:<function> (docs/JOB.md)")
    if config.job.environment not in ("auto", "agent"):
        raise ConfigError(f"job.agent={agent!r} and job.environment={config.job.environment!r}: an agent is its own "
                          "environment; set one of them (leave job.environment at 'auto')")
    for key, value in (("model.hf_path", config.rl.model.hf_path), ("data.train_files", config.data.train_files)):
        if not value:
            raise ConfigError(f"job.agent={agent!r} needs {key}; set it (docs/JOB.md)")
    if not engine_entry(config.rollout).capabilities.agent_calls:  # (an unknown name: ConfigError listing them)
        raise ConfigError(f"job.agent={agent!r} samples its calls on the vLLM fleet, but rollout.engine="
                          f"{config.rollout.engine!r}; remove it (vllm is implied; bash scripts/setup_engine.sh "
                          "installs the engine)")
    if not config.rl.stepwise.step_wise_trajectories:
        raise ConfigError(f"job.agent={agent!r} trains step-wise, one step per call: "
                          "stepwise.step_wise_trajectories=false is the one value it cannot take; remove it (true "
                          "is implied)")
    if config.rollout.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"rollout.tool_call_parser={config.rollout.tool_call_parser!r} is not one of "
                          f"{sorted(TOOL_CALL_PARSERS)}")


def next_digit_longest_sequence(num_turns: int, max_new_tokens: int) -> int:
    """Tokens of the digit game's longest sequence in either rollout layout (``check_rollout_shapes``)."""
    return num_turns * (max_new_tokens + 3)


def check_rollout_shapes(config: JobConfig) -> None:
    """The digit game's longest sequence, ``next_digit.num_turns x (job.max_new_tokens + 3)`` (a 3-token first
    prompt, then per turn a response of at most ``max_new_tokens`` and, but after the last turn, a 3-token
    observation), must fit the model's positions and, with a token budget, one micro-batch (packed to the
    alignment of ``data/packing.py: packing_alignment``). The config alone decides both, so they are
    ConfigErrors at load (the pre-flight's, before any rank starts) instead of the trainer's ValueError after
    the first rollouts."""
    from megatron_rl.data.packing import packing_alignment

    turns, new_tokens = config.next_digit.num_turns, config.job.max_new_tokens
    longest = next_digit_longest_sequence(turns, new_tokens)
    shape = (f"next_digit.num_turns x (job.max_new_tokens + 3) = {turns} x ({new_tokens} + 3) = {longest} tokens")
    rl = config.rl
    if longest > rl.model.max_position_embeddings:
        raise ConfigError(
            f"model.max_position_embeddings={rl.model.max_position_embeddings} is below the game's longest "
            f"sequence, {shape}; set model.max_position_embeddings={longest} (or more), or lower "
            "next_digit.num_turns / job.max_new_tokens"
        )
    budget = rl.batch.max_tokens_per_micro_batch
    parallel = rl.parallel
    align = packing_alignment(parallel.tensor_model_parallel_size, parallel.context_parallel_size,
                              parallel.sequence_parallel)
    packed = -(-longest // align) * align
    if isinstance(budget, int) and budget < packed:  # "auto" is never below a sequence
        raise ConfigError(
            f"batch.max_tokens_per_micro_batch={budget} is below one sequence of the game, {shape}"
            + (f", packed to {packed} (a multiple of {align})" if packed != longest else "")
            + f"; set batch.max_tokens_per_micro_batch={packed} (or more), or lower next_digit.num_turns / "
            "job.max_new_tokens"
        )


MOVED_KEYS = {
    "batch.n_samples_per_prompt": "job.n_samples_per_prompt",
    **{f"demo.{key}": f"job.{key}" for key in ("num_steps", "n_samples_per_prompt", "max_new_tokens", "temperature")},
    **{f"demo.{key}": f"next_digit.{key}" for key in ("num_turns", "digit_offset", "baseline_episodes")},
}
"""Old key -> its place now; both spellings are read (YAML files and overrides written before the move)."""

JOB_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("steps", "total_steps", "train_steps", "max_steps"), ("job.num_steps",)),
    **dict.fromkeys(("group_size", "n_samples", "rollout_n", "num_generations"), ("job.n_samples_per_prompt",)),
    "turns": ("next_digit.num_turns",),
    "temp": ("job.temperature",),
    **dict.fromkeys(("max_response_length", "max_tokens"), ("job.max_new_tokens",)),
    **dict.fromkeys(("train_data", "train_file", "dataset"), ("data.train_files",)),
    **dict.fromkeys(("val_data", "val_file", "test_files"), ("data.val_files",)),
    **dict.fromkeys(("reward_fn", "reward_function", "custom_reward_function"), ("reward.function",)),
    **dict.fromkeys(("eval_interval", "test_freq"), ("eval.interval",)),
    "max_prompt_length": ("data.max_prompt_tokens",),
}
"""Common names of the job's keys (added to ``megatron_rl.config.KEY_ALIASES`` for suggestions)."""


def job_schema() -> Schema:
    schema = Schema.of(MegatronRLConfig)
    for name in JobConfig.SECTIONS:
        schema = schema | Schema.of(JobConfig.__dataclass_fields__[name].default_factory, f"{name}.")  # type: ignore
    return schema


def load_job_config(path: str | Path | Sequence[str | Path] | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults <- YAML at ``path`` (several: the layers of ``job/paths.py: config_layers``, each over the ones
    before; a user's top-level ``base:`` key is theirs, not a setting) <- dotted overrides, for the library
    sections and the job's; validated once.

    Settings the task allows one value for are derived where unset (``job/implied.py``: a step-API class or an
    agent trains step-wise). Relative paths (``model.hf_path``, ``data.*_files``, ``reward.function``'s file, ``logging.output_dir``, ...)
    are made absolute against the caller's directory (``job/paths.py``). Raises ``ConfigError`` naming the key
    (unknown keys get a suggestion). The world size is checked later, by ``initialize_distributed`` (and the
    pre-flight).
    """
    flat = read_overrides(path, overrides, renames=MOVED_KEYS)
    flat.pop(BASE_KEY, None)  # what a user's YAML builds on: read by config_layers
    flat = resolve_path_keys(flat)  # from where the user stands
    flat = with_implied(flat)  # settings with one valid value given the task (job/implied.py)
    check_keys(flat, job_schema(), {**KEY_ALIASES, **JOB_KEY_ALIASES})
    sections = {name: build_config(JobConfig.__dataclass_fields__[name].default_factory, flat, f"{name}.")  # type: ignore
                for name in JobConfig.SECTIONS}
    return JobConfig(rl=with_checkpoint_model(build_config(MegatronRLConfig, flat)), **sections)


def with_checkpoint_model(rl: MegatronRLConfig) -> MegatronRLConfig:
    """``rl`` with, when ``model.hf_path`` has a config.json, the model section its family reads from it
    (``hf/config.py: model_config_from_hf``: shapes, ``model.family``; the other keys kept): resolved here,
    once, so that the pre-flight's checks, the engine checks and every rank read the same section (the output
    directory's config.yaml holds it). ConfigError naming ``model.hf_path`` (or ``model.family``) for a
    checkpoint no family reads; a folder without config.json is left to the environment and the loader, which
    say so."""
    model = rl.model
    if model.hf_path is None or not (Path(model.hf_path) / "config.json").is_file():
        return rl
    from megatron_rl.hf.config import model_config_from_hf

    try:
        return dataclasses.replace(rl, model=model_config_from_hf(model.hf_path, base=model, key="model.hf_path"))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def dump_job_config(config: JobConfig, path: str | Path) -> None:
    """Write the resolved job config as YAML (atomically); ``load_job_config(path)`` gives it back."""
    write_yaml(config.to_dict(), path)
