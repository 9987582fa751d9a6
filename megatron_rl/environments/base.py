"""The environment protocol: what the main job asks of a task (prompts, turns, rewards, evaluation).

Place in the data flow: the first stage of every RL step of the main job (``megatron_rl/job/main.py``)::

    environment.rollout(engine, spec, ...)  ->  Rollouts(GeneratorOutput, metrics)  ->  Trainer.train_step

An environment owns its tokenizer (what it writes prompts with and decodes responses with) and its data;
the job owns the model, the engine (``megatron_rl/inference``) and the sampling settings. Implementations:
``next_digit`` (a multi-turn game with its own 16-token vocabulary) and ``single_turn`` (prompts from a file,
one response each, a user's reward function); ``registry.py`` maps ``job.environment`` to them.

Contract: ``rollout`` and ``evaluate`` are collective (every rank calls them with the same arguments, through
a collective engine, and gets the same result); given ``(seed, step)``, the weights and the state restored by
``load_state_dict``, a rollout is deterministic, so a resumed run replays the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.data.generator_output import GeneratorOutput
from megatron_rl.environments.failures import SampleFailure
from megatron_rl.inference.engine import RolloutEngine, SamplingSpec


@dataclass
class Sample:
    """One decoded sample for people to read (``samples.jsonl``, TensorBoard text, the summary)."""

    prompt: str
    response: str
    reward: float | None
    """None when scoring it failed (``error`` says why)."""
    row: int | None = None
    """The data row of its prompt, when there is one."""
    error: str | None = None
    turns: list[dict[str, Any]] | None = None
    """A multi-turn episode, whole: per turn the prompt text new to it (observation, tool result), the reply and,
    for an agent, its parsed tool calls (``conversation.py: readable_turns``; special tokens kept); ``prompt``
    is then the first prompt and ``response`` the last reply. None for one turn."""
    end: str | None = None
    """Why a multi-turn episode ended (``done``, ``max_turns``, ``context``, ``failed``); None for one turn."""


@dataclass
class Rollouts:
    """One RL step's rollouts and what the environment measured while producing them."""

    output: GeneratorOutput
    """The sequences for ``Trainer.train_step`` (rewards included; failed samples already dropped:
    ``environments/failures.py``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra scalars to log (e.g. ``reward_fn/<name>`` from a reward function, ``data/epoch``,
    ``rollout/failed_samples``)."""
    samples: list[Sample] = field(default_factory=list)
    """A few decoded samples, one per prompt, the first prompts of the step (the job logs them every
    ``logging.sample_interval`` steps); may be empty."""
    failures: list[SampleFailure] = field(default_factory=list)
    """The samples whose scoring raised this step (the job prints the run's first one)."""
    token_versions: dict[int, int] | None = None
    """Trained tokens per weight version (syncs before them) that the engine's ``generate`` did not count: an
    agent's calls with ``rollout.partial_rollouts`` (``conversation.weight_versions``); None otherwise."""


@dataclass
class Evaluation:
    """One evaluation: ``eval/*`` metrics and a few decoded samples (logged at every evaluation)."""

    metrics: dict[str, float]
    samples: list[Sample] = field(default_factory=list)
    failures: list[SampleFailure] = field(default_factory=list)


class Environment(Protocol):
    """A task the main job trains on. See the module docstring for the collective/determinism contract."""

    pad_token_id: int
    """Pad id of the environment's tokenizer (the policy pads with it)."""
    stop_token_ids: tuple[int, ...]
    """Tokens that end a response (the tokenizer's eos)."""

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        """``num_prompts`` prompts, each answered ``n_samples_per_prompt`` times (one GRPO group, one uid)."""
        ...

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        """``eval/reward_mean`` and ``eval/pass_rate`` (share of responses with reward >= ``pass_threshold``)
        over held-out prompts, one response each (failed ones left out, counted as ``eval/failed_samples``),
        and a few decoded samples; empty metrics when the environment has no held-out prompts."""
        ...

    def random_baseline(self, seed: int) -> float | None:
        """Mean reward of a uniformly random policy (the summary's reference line), or None if not defined."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position in the data (JSON-serializable); saved in every checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` (a resume); ``{}`` (a checkpoint without it) leaves the start position."""
        ...


def pass_metrics(rewards: list[float | None], threshold: float) -> dict[str, float]:
    """``eval/reward_mean`` and ``eval/pass_rate`` of held-out rewards (one response per prompt; None = failed,
    left out and counted as ``eval/failed_samples`` when there are any)."""
    scored = [r for r in rewards if r is not None]
    failed = {"eval/failed_samples": float(len(rewards) - len(scored))} if len(scored) < len(rewards) else {}
    if not scored:
        return failed
    return {"eval/reward_mean": sum(scored) / len(scored),
            "eval/pass_rate": sum(r >= threshold for r in scored) / len(scored), **failed}
