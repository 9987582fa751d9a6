"""The rollout-engine contract: prompts (token ids) in, sampled responses with their log-probs out.

Place in the data flow: the main job (``job/main.py``) starts the engine ``rollout.engine`` names through the
registry (``inference/registry.py``), its rollout stage calls ``generate`` once per turn (or per batch of
prompts), then ``update_weights`` after the optimizer steps of an RL step. ``RolloutEngine`` below is everything
the job, its pipeline (``job/pipeline.py``) and the environments use; what an engine can do is declared in its
``capabilities`` (``EngineCapabilities``), never probed. Two implementations ship:

- ``BuiltinEngine`` (``builtin_engine.py``, the policy's own packed forward): every rank runs it;
- ``VLLMEngine`` (``vllm/engine.py``): global rank 0 owns a fleet of vLLM servers, the others receive its output.

Both are *collective*: every trainer rank calls ``generate`` with the same arguments and gets the same
completions back, so the ranks train on identical data without further communication. A new engine implements
``RolloutEngine`` and registers a factory with ``registry.register_engine`` (docs/INFERENCE.md section 7).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


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


class EngineError(RuntimeError):
    """An engine could not serve (a request it refused, no engine left): the job stops with one line."""


class EngineStartError(RuntimeError):
    """An engine did not start (the message names why, e.g. the tail of its log): the job stops with one line."""


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What an engine can do, declared by its registration (``registry.register_engine``) and on every instance
    (``RolloutEngine.capabilities``): the config checks and the job ask these, never the engine's name."""

    own_weights: bool = False
    """It samples from its own copy of the weights: ``update_weights`` moves them every ``rollout.sync_interval``
    steps (its ``last_sync_bytes`` is logged as ``rollout/weight_sync_bytes``) and, on-policy, its log-probs are
    checked against the trainer's (``inference/config.py: AGREEMENT_BOUNDS``). False: it samples from the live
    policy (``update_weights`` is never called)."""
    concurrent: bool = False
    """``generate`` may run on a rollout thread while the main thread trains (``rollout.max_staleness`` >= 1
    overlaps them: ``job/pipeline.py``); its collectives then go over the thread's group, and a collective it
    needs from the main thread goes through ``run_on_main_thread``."""
    sleeps: bool = False
    """``sleep`` / ``wake`` free and take back its device memory around the optimizer steps
    (``rollout.sleep_while_training``); False: the job never calls them."""
    partial_rollouts: bool = False
    """``update_weights`` can pause the generation in flight and let it finish on the new weights, labelling each
    token with its weight version (``take_token_versions``; ``rollout.partial_rollouts``)."""
    own_nodes: bool = False
    """Its engines can run on nodes of their own, started by each such node's engine host
    (``rollout.engine_nodes``; ``inference/nodes.py``); False: it samples on the trainer's ranks or devices."""
    agent_calls: bool = False
    """It serves single requests of agent sessions on global rank 0 (``agent_calls``, ``admit_replacements``;
    ``job.agent``)."""


class AgentCalls(Protocol):
    """Global rank 0's single requests of agent sessions (not collective, thread-safe): what
    ``environments/agent/`` samples an OpenAI-client agent's calls with."""

    calls_waiting: Any
    """A ``threading.Event`` set while a call waits for a collective step of the job (no engine serves): the
    environment's loop then runs ``RolloutEngine.admit_replacements`` on every rank."""

    def complete(self, prompt: list[int], spec: SamplingSpec, *, seed: int, session: str, images: Any = None
                 ) -> Completion:
        """One sampled reply; a session's calls may stay on one server (its prefix cache). ``images``: the
        prompt's images (``inference/vllm/images.py: EngineImages``), passed only for a prompt that has some."""
        ...

    def end_session(self, session: str) -> None:
        """The session ended: forget where its calls went."""
        ...

    def serving(self) -> Sequence[Any]:
        """What serves now (empty: nothing; the agents' episode clocks pause meanwhile)."""
        ...


class RolloutEngine(Protocol):
    """The whole contract of a rollout engine. Methods are collective over the trainer's ranks unless they say
    otherwise; the optional ones are called only when ``capabilities`` declares them."""

    capabilities: EngineCapabilities
    """What it can do (the same object as its registration's)."""
    version: int
    """Weight syncs so far (0: the weights it started on)."""
    last_sync_bytes: int
    """Bytes one engine received in the last ``update_weights`` (logged as ``rollout/weight_sync_bytes``)."""
    run_on_main_thread: Callable[[Callable[[], Any]], Any] | None
    """Set by the pipeline when it generates on a rollout thread (``capabilities.concurrent``): runs a
    collective the engine needs during ``generate`` on the main thread, between training steps."""

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int) -> list[Completion]:
        """One completion per prompt, identical on every rank; ``seed`` makes the draws reproducible. A call
        that repeats the previous call's seed continues its random stream (so the turns of a multi-turn step,
        which pass the step's seed, draw different numbers); a new seed starts a fresh one. Prompts with images
        (``data.image_key``) go only to an engine that takes ``images=`` (``BuiltinEngine``, ``VLLMEngine``:
        the registry refuses others at start-up)."""
        ...

    def update_weights(self, policy: Any) -> float:
        """Make the engine sample from ``policy``'s current weights; returns the seconds it took (0 if shared)."""
        ...

    def step_metrics(self) -> dict[str, float]:
        """Engine health since the last call (e.g. ``rollout/engine_restarts``), merged into the step's metrics;
        ``{}`` when there is none."""
        ...

    def sleep(self) -> None:
        """(``capabilities.sleeps``) Free the engine's device memory while the trainer trains."""
        ...

    def wake(self) -> None:
        """(``capabilities.sleeps``) Take it back, before the next sync or generation."""
        ...

    def take_token_versions(self) -> Counter:
        """(``capabilities.partial_rollouts``) Generated tokens per weight version since the last call."""
        ...

    @property
    def agent_calls(self) -> AgentCalls | None:
        """(``capabilities.agent_calls``) Global rank 0's single requests (None on the other ranks)."""
        ...

    def admit_replacements(self) -> None:
        """(``capabilities.agent_calls``) Collective, when ``agent_calls.calls_waiting`` is set: bring serving
        capacity back (e.g. a replacement engine, given the current weights). EngineError if none comes."""
        ...

    def close(self) -> None:
        """Release the engine (processes, groups); safe to call twice."""
        ...
