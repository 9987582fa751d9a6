"""A user's OpenAI-client agent as an ``Environment`` (``environments/base.py``): ``job.agent=<file.py>:<function>``.

Place in the data flow: ``job/main.py`` -> ``AgentEnvironment.rollout`` (every rank) ->
``distributed/rank0.on_rank0`` (global rank 0 plays, every rank receives the same ``GeneratorOutput``)::

    PromptOrder.next (seeded, checkpointed) -> per row n episodes (one GRPO group, uid = the row's index in the step)
      -> up to job.max_concurrency threads: function(base_url=<episode URL>, **row) -> reward (or {"reward": ...})
           each chat.completions call -> endpoint.Session (render, sample on the fleet, record, parse tool calls)
      -> trajectory_rows of the episode's calls (step-wise; merged where prompts extend; reward on the last step)

The user's function::

    def my_agent(base_url: str, **row) -> float | dict:   # one episode; the row's columns as keyword arguments
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        ...client.chat.completions.create(model="any", messages=..., tools=...)...
        return reward                                     # or {"reward": reward, ...}

An episode whose function raises, returns no finite reward, or made no call is left out of training
(``environments/failures.py``: counted in ``rollout/failed_samples``, the job prints the run's first one; a group
left with fewer than two episodes keeps a zero-loss placeholder so the batch holds every prompt); a step where
every episode failed stops the run with one line (``AllSamplesFailed``). A call the fleet cannot serve stops the
step with an ``EngineError`` on every rank.

Determinism: the seed of each call is a function of (rollout seed, row, sample, call index within the episode),
and one episode's calls stay on one engine (``Fleet.complete``'s session); an agent that makes its calls in an
order fixed by its row and the replies gets the same samples on a rerun or a resume.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.environments.agent.endpoint import AgentEndpoint, Session
from megatron_rl.environments.agent.tool_parsers import tool_call_parser
from megatron_rl.environments.base import Evaluation, Rollouts, Sample, pass_metrics
from megatron_rl.environments.conversation import episode_sample, trajectory_rows, weight_versions
from megatron_rl.environments.episodes import run_episodes
from megatron_rl.environments.failures import EpisodeRows, SampleFailure, assemble_episodes, failure
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.single_turn.data import PromptOrder, read_rows
from megatron_rl.environments.turn_images import TurnImages
from megatron_rl.environments.user_code import load_object
from megatron_rl.inference.engine import RolloutEngine, SamplingSpec

KEY = "job.agent"


@dataclass
class Episode:
    row: Mapping[str, Any]
    index: int
    """The row's index in its data file."""
    uid: int
    sample: int
    session: Session | None = None
    base_url: str | None = None
    timed_out: bool = False
    """Given up past ``job.episode_timeout_s`` (its function may still be running: nothing it does counts)."""
    reward: float = 0.0
    error: str | None = None
    """Why the episode failed, one line after ``function(base_url, **row)`` ("raised KeyError: ..."); None when
    it did not."""
    raised: BaseException | None = None
    """The exception behind ``error`` (its traceback: ``failures.py: raised_at``)."""


def call_seed(seed: int, row: int, sample: int, call: int) -> int:
    """The sampling seed of one agent call: a hash of (rollout seed, row index in the step, sample, call index)."""
    digest = hashlib.blake2b(f"{seed}:{row}:{sample}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63


class AgentEnvironment:
    def __init__(self, spec: str, data: DataConfig, tokenizer: Any, *, seed: int, max_concurrency: int,
                 max_prompt_tokens: int, tool_call_parser_name: str, max_rows: int | None = None,
                 episode_timeout_s: float = 900.0, teacher_of: Callable[[Mapping[str, Any]], int] | None = None,
                 images: TurnImages | None = None) -> None:
        """``max_rows``: read only the first rows of each data file (the pre-flight's check). ``teacher_of``: a
        data row -> its distillation teacher (``distillation/routing.py: router``), written to
        ``GeneratorOutput['teacher_ids']`` for every call of the row's episodes; None: no routing. ``images``:
        the checkpoint's image encoder, for the ``image_url`` parts of the agent's messages (None: refused)."""
        self.episode_timeout_s, self.teacher_of, self.images = episode_timeout_s, teacher_of, images
        self._episode_lock = threading.Lock()
        from megatron_rl.hf.tokenizer import pad_token_id, stop_token_ids

        self.spec, self.function = spec, load_agent(spec)
        self.name = getattr(self.function, "__name__", spec)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{KEY}={spec!r} needs a tokenizer with a chat template (the agent's messages are "
                              "rendered with it); model.hf_path's tokenizer has none: add chat_template to its "
                              "tokenizer_config.json")
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id(tokenizer)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self.train = read_rows(data.paths("train_files"), "data.train_files", max_rows=max_rows)
        self.val = (read_rows(data.paths("val_files"), "data.val_files", max_rows=max_rows)
                    if data.paths("val_files") else None)
        check_signature(self.function, spec, self.train[0], "row 0 of data.train_files")
        self.order = PromptOrder(len(self.train), seed=seed, shuffle=data.shuffle)
        self.max_concurrency, self.max_prompt_tokens = max_concurrency, max_prompt_tokens
        self.parser_name, self.parse = tool_call_parser_name, tool_call_parser(tool_call_parser_name)
        self.endpoint: AgentEndpoint | None = None
        """Started at the first rollout, on global rank 0 only."""
        self._tokenizer_lock = threading.Lock()

    def describe(self) -> str:
        rows = f"train: {len(self.train)} rows" + (f"; val: {len(self.val)} rows" if self.val else "")
        return (f"agent {self.name} ({self.spec}): {rows}; up to {self.max_concurrency} episodes at once "
                f"(job.max_concurrency); tool calls parsed as {self.parser_name} (rollout.tool_call_parser); "
                f"at most {self.max_prompt_tokens} prompt tokens per call")

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        from megatron_rl.distributed.rank0 import on_rank0

        assert step_wise, "JobConfig checks that an agent trains step-wise"
        indices = self.order.next(num_prompts)  # every rank: the data position is state
        episodes = [Episode(self.train[i], i, uid, k) for uid, i in enumerate(indices)
                    for k in range(n_samples_per_prompt)]
        epoch = float(self.order.epoch)

        def play() -> Rollouts:
            failures = self._failures(episodes)
            output, metrics = assemble_episodes(  # a given-up episode's turns (it may still be calling) do not count
                [EpisodeRows(trajectory_rows(ep.session.turns, reward=ep.reward, uid=ep.uid,
                                             trajectory_id=(ep.uid, ep.sample))
                             if ep.session.turns and not ep.timed_out else [],
                             ep.uid, (ep.uid, ep.sample), ep.error is not None) for ep in episodes],
                pad_token_id=self.pad_token_id, eos_token_id=self.stop_token_ids[0], what=f"{KEY}={self.spec!r}",
                first_failure=failures[0].line(self.name) if failures else None,
                teacher_ids={ep.uid: self.teacher_of(ep.row) for ep in episodes} if self.teacher_of else None)
            finished = [ep for ep in episodes if ep.error is None]
            metrics.update(episode_metrics(finished))
            versions, tokens = weight_versions([ep.session.turns for ep in finished])  # partial rollouts
            metrics.update(versions)
            metrics["data/epoch"] = epoch
            samples = self._samples(episodes[::n_samples_per_prompt])
            return Rollouts(output, metrics, samples=samples, failures=failures,  # type: ignore[arg-type]
                            token_versions=tokens or None)

        self.play_everywhere(episodes, engine, spec, seed)
        return on_rank0(play)

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        from megatron_rl.distributed.rank0 import on_rank0

        if self.val is None:
            return Evaluation({})
        rows = self.val[:num_prompts] if num_prompts else self.val

        episodes = [Episode(row, i, i, 0) for i, row in enumerate(rows)]

        def play() -> Evaluation:
            rewards = [None if ep.error is not None else ep.reward for ep in episodes]
            return Evaluation(pass_metrics(rewards, pass_threshold), self._samples(episodes),
                              self._failures(episodes))

        self.play_everywhere(episodes, engine, spec, seed)
        return on_rank0(play)

    def play_everywhere(self, episodes: list[Episode], engine: RolloutEngine, spec: SamplingSpec, seed: int) -> None:
        """Collective: global rank 0 plays the episodes (``play``, in a thread); meanwhile, whenever its calls wait
        for a replacement engine (none serves: ``AgentCalls.calls_waiting``), every rank joins the admission that
        gives the replacement the current weights (``RolloutEngine.admit_replacements``), and the calls go on. An
        error of the play (an engine that cannot come back) is raised on every rank."""
        from megatron_rl.distributed.rank0 import is_global_rank0, on_rank0

        outcome: dict[str, Any] = {}
        player = None
        if is_global_rank0():
            def run() -> None:
                try:
                    self.play(episodes, engine, spec, seed)
                except Exception as err:  # noqa: BLE001 - raised on every rank by ``played``
                    outcome["error"] = err

            player = threading.Thread(target=run, name="megatron_rl-agent-play", daemon=True)
            player.start()

        def played() -> bool:
            """Rank 0: True when the play ended, False when a replacement engine must be admitted first."""
            calls = engine.agent_calls
            while player.is_alive():
                player.join(timeout=0.2)
                if calls.calls_waiting.is_set() and player.is_alive():
                    if not calls.serving():
                        return False
                    calls.calls_waiting.clear()  # an engine serves again: the calls went on
            if "error" in outcome:
                raise outcome["error"]
            return True

        while not on_rank0(played):
            engine.admit_replacements()

    def play(self, episodes: list[Episode], engine: RolloutEngine, spec: SamplingSpec, seed: int) -> None:
        """Run every episode (``max_concurrency`` at once) against ``engine``'s agent calls (the vLLM fleet):
        each gets its reward or its error. Rank 0 only. EngineError when a call could not be served."""
        fleet = engine.agent_calls
        assert fleet is not None, ("JobConfig checks that rollout.engine serves agent calls "
                                   "(capabilities.agent_calls); they live on global rank 0")
        if self.endpoint is None:
            self.endpoint = AgentEndpoint()
        for ep in episodes:
            ep.session = Session(f"agent-{seed}-{ep.uid}-{ep.sample}", self.tokenizer, fleet.complete, spec,
                                 seed_of_call=lambda call, ep=ep: call_seed(seed, ep.uid, ep.sample, call),
                                 max_prompt_tokens=self.max_prompt_tokens, parse=self.parse,
                                 tokenizer_lock=self._tokenizer_lock, images=self.images)
        run_episodes(episodes, lambda ep: self._run(ep, fleet), concurrency=self.max_concurrency,
                     timeout_s=self.episode_timeout_s, on_timeout=lambda ep, seconds: self._give_up(ep, fleet),
                     describe=lambda ep: f"row {ep.index} (sample {ep.sample})", what=f"{KEY} episode(s)",
                     paused=lambda: not fleet.serving())
        engine_error = next((ep.session.engine_error for ep in episodes
                             if ep.session.engine_error and not ep.timed_out), None)
        if engine_error is not None:
            from megatron_rl.inference.engine import EngineError

            raise EngineError(f"an agent call could not be served: {engine_error}")

    def _run(self, ep: Episode, fleet: Any) -> None:
        """One episode: the user's function against its own URL; its reward, or its error."""
        session = ep.session
        assert session is not None and self.endpoint is not None
        base_url = ep.base_url = self.endpoint.open(session)
        try:
            result = self.function(base_url=base_url, **ep.row)
        except Exception as err:  # noqa: BLE001 - the user's code: the episode fails, the run goes on
            result, error = None, f"raised {failure(0, None, err).error}"
            ep.raised = err
        else:
            error = None
        finally:
            self.endpoint.close_session(base_url)
            fleet.end_session(session.name)
        with self._episode_lock:
            if not ep.timed_out:
                self._score(ep, result, error)

    def _give_up(self, ep: Episode, fleet: Any) -> None:
        """``ep`` ran past ``job.episode_timeout_s``: a failed sample; its URL stops answering its calls."""
        with self._episode_lock:
            ep.timed_out = True
            ep.error = (f"ran past job.episode_timeout_s={self.episode_timeout_s:g} s: given up (its function runs on "
                        "in the background; its result is dropped)")
        print(f"megatron_rl: {KEY} episode of row {ep.index} (sample {ep.sample}) ran past job.episode_timeout_s="
              f"{self.episode_timeout_s:g} s: counted as a failed sample (rollout/failed_samples), the step goes on",
              flush=True)
        if ep.base_url is not None:
            self.endpoint.close_session(ep.base_url)
        fleet.end_session(ep.session.name)

    def _score(self, ep: Episode, result: Any, error: str | None) -> None:
        """The episode's reward from its function's ``result``, or its error."""
        if error is not None:
            ep.error = error
            return
        session = ep.session
        reward = as_reward(result)
        if reward is None:
            ep.error = (f"returned {str(result)[:80]!r} ({type(result).__name__}): it must return a finite number "
                        "or a dict with 'reward'")
        elif not session.turns:
            ep.error = ("made no chat.completions call that was served: an episode trains on its calls"
                        + (f" ({session.context_error})" if session.context_error else ""))
        else:
            ep.reward = reward

    def _failures(self, episodes: list[Episode]) -> list[SampleFailure]:
        return [failure(i, ep.index, f"{self.name}(base_url, **row) {ep.error}", raised=ep.raised)
                for i, ep in enumerate(episodes) if ep.error is not None]

    def _samples(self, episodes: list[Episode]) -> list[Sample]:
        """Each episode whole: every call's new prompt text (the agent's messages, tool results), reply and parsed
        tool calls, the reward, why it ended (``conversation.py: episode_sample``; special tokens kept)."""
        return [episode_sample(ep.session.turns if ep.session is not None else [], self.tokenizer,
                               reward=None if ep.error else ep.reward, row=ep.index, error=ep.error,
                               end=episode_end(ep), tool_calls=self._tool_calls) for ep in episodes]

    def _tool_calls(self, response_ids: list[int]) -> list[dict]:
        """The tool calls the endpoint answered for a reply (the parser again, on the same text: it is pure)."""
        ids = response_ids[:-1] if response_ids and response_ids[-1] in self.stop_token_ids else response_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return [{"name": call.name, "arguments": call.arguments} for call in self.parse(text).tool_calls]

    def random_baseline(self, seed: int) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.order.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.consumed = int(state.get("consumed", 0))


def episode_end(ep: Episode) -> str:
    """Why an agent's episode ended: 'failed', 'context' (a call was refused for length), else 'done' (the
    function returned)."""
    if ep.error is not None:
        return "failed"
    return "context" if ep.session is not None and ep.session.context_error else "done"


def load_agent(spec: str) -> Any:
    function = load_object(spec, KEY, "function")
    if not callable(function) or inspect.isclass(function):
        raise ConfigError(f"{KEY}={spec!r} names a {type(function).__name__}, not a function "
                          "function(base_url, **row) -> reward (docs/JOB.md)")
    return function


def check_signature(function: Any, spec: str, row: Mapping[str, Any], what: str) -> None:
    """ConfigError when ``function(base_url=..., **row)`` cannot be called with ``row``'s columns."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin or C callable: found out at the first episode
    try:
        signature.bind(base_url="http://127.0.0.1:1/token/v1", **row)
    except TypeError as err:
        raise ConfigError(f"{KEY}={spec!r}: {getattr(function, '__name__', spec)}(base_url, **row) cannot take "
                          f"{what}, whose columns are {sorted(row)}: {err}; define it as "
                          "def agent(base_url, **row) or name the columns it takes") from None


def as_reward(result: Any) -> float | None:
    """The episode's reward from the function's return: a finite number, or a dict's ``reward``; else None."""
    if isinstance(result, Mapping):
        result = result.get("reward")
    if hasattr(result, "item") and getattr(result, "ndim", 1) == 0:  # numpy / torch scalars
        result = result.item()
    if isinstance(result, (int, float)) and not isinstance(result, bool) and math.isfinite(float(result)):
        return float(result)
    return None


def episode_metrics(finished: list[Episode]) -> dict[str, float]:
    """Per episode: calls, new steps (calls whose prompt did not extend the previous one), calls refused for
    length; per call: the reply length."""
    count = max(len(finished), 1)
    turns = [t for ep in finished for t in ep.session.turns]
    return {"episode/calls_mean": len(turns) / count,
            "episode/new_steps_mean": sum(ep.session.conversation.new_steps for ep in finished) / count,
            "episode/ended_context": float(sum(ep.session.context_error is not None for ep in finished)),
            "episode/response_tokens_mean": sum(len(t.response_ids) for t in turns) / max(len(turns), 1)}
