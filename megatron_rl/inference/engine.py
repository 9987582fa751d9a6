"""The rollout-engine protocol: prompts (token ids) in, sampled responses with their log-probs out.

Place in the data flow: the main job's rollout stage calls ``generate`` once per turn (or per batch of
prompts), then ``update_weights`` after the optimizer steps of an RL step. Two implementations:

- ``BuiltinEngine`` (``builtin_engine.py``, the policy's own packed forward): every rank runs it;
- ``VLLMEngine`` (``vllm_engine.py``): global rank 0 owns a vLLM engine process, the others receive its output.

Both are *collective*: every trainer rank calls ``generate`` with the same arguments and gets the same
completions back, so the ranks train on identical data without further communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How to sample one response per prompt."""

    max_tokens: int
    """Response length cap; a response that reaches it without a stop token ends with finish reason 'length'."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy. Log-probs are those of the distribution sampled from."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (kept in the response)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]
    """Generated tokens (a sampled stop token included)."""
    logprobs: list[float]
    """Log-prob of each generated token under the sampling distribution (same length as ``token_ids``)."""
    finish_reason: str
    """'stop' (a stop token was sampled) or 'length' (``max_tokens`` reached)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific extras (e.g. routed experts); empty by default."""


class RolloutEngine(Protocol):
    """What the rollout stage needs from an engine. Every method is collective over the trainer's ranks."""

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int) -> list[Completion]:
        """One completion per prompt, identical on every rank; ``seed`` makes the draws reproducible. A call
        that repeats the previous call's seed continues its random stream (so the turns of a multi-turn step,
        which pass the step's seed, draw different numbers); a new seed starts a fresh one."""
        ...

    def update_weights(self, policy: Any) -> float:
        """Make the engine sample from ``policy``'s current weights; returns the seconds it took (0 if shared)."""
        ...

    def step_metrics(self) -> dict[str, float]:
        """Engine health since the last call (e.g. ``rollout/engine_restarts``); ``{}`` when there is none."""
        ...

    def close(self) -> None:
        """Release the engine (processes, groups); safe to call twice."""
        ...
