"""The demo job's configuration: the library's ``MegatronRLConfig`` plus the demo's own ``demo`` section.

Place in the data flow: read once by the main job (``demo/main.py``) before anything else. Both parts come from
the same YAML file (``configs/demo_cpu.yaml``): the library's sections at the top level, the demo's under
``demo:``, and the same dotted overrides (``optimizer.lr=1e-3 demo.num_steps=20``). The library never sees the
demo's fields. ``batch.n_samples_per_prompt`` (where the group size used to live) is read as
``demo.n_samples_per_prompt``: only the demo's rollouts use it.

Validation follows ``megatron_rl.config``: ``DemoConfig`` checks its fields on construction, ``DemoJobConfig``
the rules between the demo and the library config (``check_demo_config``, ``check_rollout_shapes``).
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
    ConfigError,
    ConfigSection,
    MegatronRLConfig,
    Schema,
    build_config,
    check_keys,
    config_to_dict,
    read_overrides,
    write_yaml,
)
from megatron_rl.demo.tokenizer import DigitTokenizer


@dataclass(kw_only=True)
class DemoConfig(ConfigSection):
    """The main job's toy RL loop (``demo/main.py``): how long, which game, how to sample."""

    SECTION: ClassVar[str] = "demo"

    num_steps: int = field(default=150, metadata=AT_LEAST_1)
    """RL train steps of the main job (one batch of fresh rollouts each)."""
    n_samples_per_prompt: int = field(default=4, metadata=AT_LEAST_1)
    """Episodes per game (the GRPO group size); also read from the old key batch.n_samples_per_prompt."""
    num_turns: int = field(default=3, metadata=AT_LEAST_1)
    """Turns per episode of the next-digit game (megatron_rl/demo/environment.py)."""
    digit_offset: int = field(default=1, metadata=FINITE)
    """The game's rule: the right answer to digit d is (d + digit_offset) mod 10."""
    max_new_tokens: int = field(default=3, metadata=AT_LEAST_1)
    """Response length cap per turn (the right answer takes 2 tokens: digit and stop token)."""
    temperature: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Sampling temperature (0 = greedy); 1.0 makes rollout and trainer log-probs comparable (mismatch ~0)."""
    baseline_episodes: int = field(default=2000, metadata=NON_NEGATIVE)
    """Episodes a uniformly random policy plays to estimate the random-baseline reward of the summary."""

    def max_sequence_length(self) -> int:
        """Tokens of the longest sequence the game can make: ``num_turns x (max_new_tokens + 3)`` (a 3-token
        first prompt, then per turn a response of at most ``max_new_tokens`` and, but after the last turn, a
        3-token observation; demo/environment.py). Both rollout layouts reach it (demo/rollout.py)."""
        return self.num_turns * (self.max_new_tokens + 3)


def check_demo_config(config: MegatronRLConfig, tokenizer: DigitTokenizer) -> None:
    """The demo's rules on the library config: its own 16-token vocabulary, a model trained from scratch."""
    if config.model.vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} but the demo tokenizer has {tokenizer.vocab_size} tokens; "
            f"set model.vocab_size={tokenizer.vocab_size} (configs/demo_cpu.yaml does)"
        )
    if config.model.hf_path is not None:
        raise ConfigError(f"model.hf_path={config.model.hf_path!r}: the demo trains a model from scratch on its "
                          "own 16-token vocabulary; unset model.hf_path")


def check_rollout_shapes(config: MegatronRLConfig, demo: DemoConfig) -> None:
    """The demo's longest sequence (``DemoConfig.max_sequence_length``) must fit the model's positions and, with a
    token budget, one micro-batch (packed to the alignment of ``data/packing.py: packing_alignment``). The config
    alone decides both, so they are ConfigErrors at load (the pre-flight's, before any rank starts) instead of
    the trainer's ValueError after the first rollouts."""
    from megatron_rl.data.packing import packing_alignment

    longest = demo.max_sequence_length()
    shape = (f"demo.num_turns x (demo.max_new_tokens + 3) = {demo.num_turns} x ({demo.max_new_tokens} + 3) = "
             f"{longest} tokens")
    if longest > config.model.max_position_embeddings:
        raise ConfigError(
            f"model.max_position_embeddings={config.model.max_position_embeddings} is below the demo's longest "
            f"sequence, {shape}; set model.max_position_embeddings={longest} (or more), or lower demo.num_turns / "
            "demo.max_new_tokens"
        )
    budget = config.batch.max_tokens_per_micro_batch
    parallel = config.parallel
    align = packing_alignment(parallel.tensor_model_parallel_size, parallel.context_parallel_size,
                              parallel.sequence_parallel)
    packed = -(-longest // align) * align
    if budget is not None and budget < packed:
        raise ConfigError(
            f"batch.max_tokens_per_micro_batch={budget} is below one sequence of the demo, {shape}"
            + (f", packed to {packed} (a multiple of {align})" if packed != longest else "")
            + f"; set batch.max_tokens_per_micro_batch={packed} (or more), or lower demo.num_turns / demo.max_new_tokens"
        )


@dataclass(kw_only=True)
class DemoJobConfig:
    """What the main job runs with: the library config (``rl``) and the demo section (``demo``)."""

    rl: MegatronRLConfig
    """Everything the library reads (parallel, model, optimizer, algorithm, batch, ..., seed)."""
    demo: DemoConfig = field(default_factory=DemoConfig)
    """The demo's own settings (YAML section ``demo``)."""

    def __post_init__(self) -> None:
        check_demo_config(self.rl, DigitTokenizer())
        check_rollout_shapes(self.rl, self.demo)

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout: the library's sections, then ``demo`` (``load_demo_config`` reads it back)."""
        return {**config_to_dict(self.rl), "demo": dataclasses.asdict(self.demo)}


MOVED_KEYS = {"batch.n_samples_per_prompt": "demo.n_samples_per_prompt"}
"""Old key -> its place now; both spellings are read (YAML files and overrides written before the move)."""

DEMO_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("steps", "total_steps", "train_steps", "max_steps"), ("demo.num_steps",)),
    **dict.fromkeys(("group_size", "n_samples", "rollout_n", "num_generations"), ("demo.n_samples_per_prompt",)),
    "turns": ("demo.num_turns",),
    "temp": ("demo.temperature",),
    "max_response_length": ("demo.max_new_tokens",),
}
"""Common names of the demo's keys (added to ``megatron_rl.config.KEY_ALIASES`` for suggestions)."""


def load_demo_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DemoJobConfig:
    """Defaults <- YAML at ``path`` <- dotted overrides, for the library sections and ``demo``; validated once.

    Raises ``ConfigError`` naming the key (unknown keys get a suggestion). The world size is checked later, by
    ``initialize_distributed``.
    """
    flat = read_overrides(path, overrides, renames=MOVED_KEYS)
    check_keys(flat, Schema.of(MegatronRLConfig) | Schema.of(DemoConfig, "demo."), {**KEY_ALIASES, **DEMO_KEY_ALIASES})
    return DemoJobConfig(rl=build_config(MegatronRLConfig, flat), demo=build_config(DemoConfig, flat, "demo."))


def dump_demo_config(config: DemoJobConfig, path: str | Path) -> None:
    """Write the resolved job config as YAML (atomically); ``load_demo_config(path)`` gives it back."""
    write_yaml(config.to_dict(), path)
