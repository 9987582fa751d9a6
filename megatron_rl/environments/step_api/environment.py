"""A user's step-API class as an ``Environment`` (``environments/base.py``): ``job.environment=<file.py>:<Class>``.

Place in the data flow: ``job/main.py`` -> ``StepApiEnvironment.rollout``::

    PromptOrder.next (seeded, checkpointed) -> per row n episodes: Class(**row), reset()
      -> turns in lock-step: engine.generate (all running episodes) -> Conversation.add_response -> step(text)
         -> Conversation.add_observation (extend, or a new step) -> ... until done / job.max_turns / context
      -> trajectory_rows (step-wise, the episode's summed reward on its last step) -> Trainer.train_step

The ``n`` episodes of a row are one GRPO group (uid = the row's index in the step). An episode ends when
``step`` says done, after ``job.max_turns`` turns, or when the next prompt would leave no room for a reply
(longer than ``max_prompt_tokens``: ``data.max_prompt_tokens``, else the model's context minus
``job.max_new_tokens``); each reason is counted (``episode/ended_<reason>``). An episode whose class raised or
returned the wrong shape fails that episode only: it is left out of training by the helper every environment
uses (``environments/failures.py``: its group keeps the episodes that finished, or stays as one masked
placeholder), counted in ``rollout/failed_samples``, and the job prints the run's first failure once; a step
where every episode failed stops the run (``AllSamplesFailed``). An episode that failed before its first turn
(``reset`` raised, or its first prompt is too long) has no turn to stand for it: it gets one placeholder row
(``failures.py: assemble_episodes``, shared with the agent), dropped or masked like any failed episode's rows.

Images (a vision-language checkpoint, ``images``: ``turn_images.py``): the first prompt's come from the row's
``data.image_key`` column and ``reset``, each observation's from ``step`` (``user_class.py``); every turn goes to the
engine with all the images of its prompt, and its training row carries them (``GeneratorOutput['images']``). An
image that cannot be read, or placeholders that do not match the images, fail that episode (counted, the file
named), never the run.

Determinism (the contract of ``base.py``): rows come from ``PromptOrder`` (its ``consumed`` is the checkpointed
state), replies from the engine with the step's seed, so episodes are a function of (seed, step) as long as the
class is a function of its row and the replies (a class that draws random numbers seeds them from its row).
Every rank runs the same episodes (the engine is collective).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.environments.base import Evaluation, Rollouts, Sample, pass_metrics
from megatron_rl.environments.conversation import (
    Conversation,
    episode_sample,
    has_chat_template,
    trajectory_rows,
    weight_versions,
)
from megatron_rl.data.images import ImageError
from megatron_rl.environments.episodes import EpisodeTimeout, call_within
from megatron_rl.environments.failures import EpisodeRows, SampleFailure, assemble_episodes, failure
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.single_turn.data import PromptOrder, read_rows
from megatron_rl.environments.step_api.user_class import KEY, EpisodeError, UserClass
from megatron_rl.environments.turn_images import TurnImages
from megatron_rl.inference.engine import Completion, RolloutEngine, SamplingSpec

END_REASONS = ("done", "max_turns", "context")


@dataclass
class Episode:
    row: Mapping[str, Any]
    index: int
    """The row's position in its data file (named in a failure's line)."""
    uid: int
    sample: int
    env: Any = None
    conversation: Conversation | None = None
    rewards: list[float] = field(default_factory=list)
    """The reward of each turn (``step``'s); the episode's reward is their sum."""
    end: str | None = None
    """Why it ended: one of ``END_REASONS``, or 'failed'; None while it runs."""
    error: str | None = None
    """Why it failed (one line naming the class and the call)."""
    spent_s: float = 0.0
    """Seconds spent in the class's calls so far (``job.episode_timeout_s`` bounds them)."""
    ran_out: bool = False
    """This rank's call of it ran past its time (the ranks then agree: ``_agree_on_failures``)."""
    agreed: bool = False
    """Its failure is known to every rank (``_agree_on_failures``)."""
    raised: BaseException | None = None
    """The exception behind ``error`` (its traceback: ``failures.py: raised_at``)."""


class StepApiEnvironment:
    def __init__(self, spec: str, data: DataConfig, tokenizer: Any, *, seed: int, max_turns: int,
                 max_prompt_tokens: int, episode_timeout_s: float = 900.0,
                 teacher_of: Callable[[Mapping[str, Any]], int] | None = None, images: TurnImages | None = None
                 ) -> None:
        """``teacher_of``: a data row -> its distillation teacher (``distillation/routing.py: router``), written to
        ``GeneratorOutput['teacher_ids']`` for every turn of the row's episodes; None: no routing. ``images``: the
        checkpoint's image encoder (a vision-language model; None: text only)."""
        from megatron_rl.hf.tokenizer import pad_token_id, stop_token_ids

        self.user = UserClass(spec)
        self.tokenizer, self.images = tokenizer, images
        self.pad_token_id = pad_token_id(tokenizer)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self.train = read_rows(data.paths("train_files"), "data.train_files")
        self.val = read_rows(data.paths("val_files"), "data.val_files") if data.paths("val_files") else None
        self.user.check_on_row(self.train[0], tokenizer, "row 0 of data.train_files", images)
        self.order = PromptOrder(len(self.train), seed=seed, shuffle=data.shuffle)
        self.max_turns, self.max_prompt_tokens = max_turns, max_prompt_tokens
        self.episode_timeout_s = episode_timeout_s
        self.teacher_of = teacher_of

    def describe(self) -> str:
        """One line for the log: the class, the rows, how text is rendered, the limits."""
        rows = f"train: {len(self.train)} rows" + (f"; val: {len(self.val)} rows" if self.val else "")
        text = ("the tokenizer's chat template (strings are user messages)" if has_chat_template(self.tokenizer)
                else "raw text (the tokenizer has no chat template)")
        if self.images is not None:
            text += "; turns may bring images" + (f" (the first prompt's: column {self.images.image_key!r})"
                                                  if self.images.image_key else "")
        return (f"step-API environment {self.user.name} ({self.user.spec}): {rows}; {text}; at most "
                f"{self.max_turns} turns (job.max_turns) and {self.max_prompt_tokens} prompt tokens per turn")

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        assert step_wise, "JobConfig checks that a step-API environment trains step-wise"
        episodes = [Episode(self.train[i], i, uid, k) for uid, i in enumerate(self.order.next(num_prompts))
                    for k in range(n_samples_per_prompt)]
        self.play(episodes, engine, spec, seed)
        failures = episode_failures(episodes)
        output, failure_metrics = assemble_episodes(
            [EpisodeRows(self._rows(ep), ep.uid, (ep.uid, ep.sample), ep.end == "failed") for ep in episodes],
            pad_token_id=self.pad_token_id, eos_token_id=self.stop_token_ids[0], what=f"{KEY}={self.user.spec!r}",
            first_failure=failures[0].line("the environment") if failures else None,
            teacher_ids={ep.uid: self.teacher_of(ep.row) for ep in episodes} if self.teacher_of else None)
        finished = [ep for ep in episodes if ep.end != "failed"]
        metrics = episode_metrics(finished) | failure_metrics | weight_versions(  # partial rollouts; its tokens:
            [ep.conversation.turns for ep in finished])[0]  # counted by the engine's generate
        metrics["data/epoch"] = float(self.order.epoch)
        samples = [self._sample(ep) for ep in episodes[::n_samples_per_prompt]]  # the first episode of each row
        return Rollouts(output, metrics, samples=samples, failures=failures)  # type: ignore[arg-type]

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        if self.val is None:
            return Evaluation({})
        rows = self.val[:num_prompts] if num_prompts else self.val
        episodes = [Episode(row, i, i, 0) for i, row in enumerate(rows)]
        self.play(episodes, engine, spec, seed)
        rewards = [None if ep.end == "failed" else sum(ep.rewards) for ep in episodes]
        return Evaluation(pass_metrics(rewards, pass_threshold), [self._sample(ep) for ep in episodes],
                          episode_failures(episodes))

    def play(self, episodes: list[Episode], engine: RolloutEngine, spec: SamplingSpec, seed: int) -> None:
        """Run ``episodes`` to their end, turn by turn, one ``engine.generate`` call per turn over the running ones
        (every call with ``seed``: the built-in engine continues one stream)."""
        for ep in episodes:
            self._start(ep)
        self._agree_on_failures(episodes)
        for turn in range(self.max_turns):
            running = [ep for ep in episodes if ep.end is None]
            if not running:
                break
            prompts = [ep.conversation.prompt_ids for ep in running]
            images = [ep.conversation.images for ep in running]  # every image of each prompt (None: text only)
            if any(images):  # (text prompts of a VL model: the engine's text path, e.g. the KV cache)
                completions = engine.generate(prompts, spec, seed=seed, images=images)  # type: ignore[call-arg]
            else:
                completions = engine.generate(prompts, spec, seed=seed)
            for ep, completion in zip(running, completions):
                self._advance(ep, completion, last_turn=turn == self.max_turns - 1)
            self._agree_on_failures(episodes)

    def _timed(self, ep: Episode, what: str, fn: Any) -> Any:
        """The class's call ``fn()`` within the episode's time left (``job.episode_timeout_s``); EpisodeError
        when it runs out (the episode's ``ran_out``: the ranks agree on it after the turn)."""
        started = time.monotonic()
        try:
            return call_within(fn, self.episode_timeout_s - ep.spent_s,
                               lambda: f"row {ep.index} (sample {ep.sample}) in {self.user.name}.{what}")
        except EpisodeTimeout:
            ep.ran_out = True
            raise EpisodeError(self._timeout_message()) from None
        finally:
            ep.spent_s += time.monotonic() - started

    def _timeout_message(self) -> str:
        return (f"{self.user.name}: the episode ran past job.episode_timeout_s={self.episode_timeout_s:g} s in its "
                "calls; given up (the call runs on in the background)")

    def _agree_on_failures(self, episodes: list[Episode]) -> None:
        """Collective: an episode that failed on any rank fails on every rank (a class that raised on one rank
        only, or the ranks' clocks on a time limit: their rollouts must not differ, or the training's collectives
        would disagree); a timeout with one line each (global rank 0)."""
        from megatron_rl.distributed.rank0 import is_global_rank0, union_over_ranks

        failed = {i for i, ep in enumerate(episodes) if ep.end == "failed" and not ep.agreed}
        late = {i for i, ep in enumerate(episodes) if ep.ran_out}
        agreed = union_over_ranks({(i, i in late) for i in failed | late})
        for i in sorted({i for i, _ in agreed} - failed):
            self._fail(episodes[i], f"{self.user.name}: the episode failed on another rank (a class that is not a "
                                    "function of its row and the replies)")
        for i in sorted({i for i, _ in agreed}):
            episodes[i].agreed = True
        for i in sorted({i for i, timed_out in agreed if timed_out}):
            ep = episodes[i]
            self._fail(ep, self._timeout_message())
            ep.ran_out = False  # failed: it plays no more turns, so it is reported once
            if is_global_rank0():
                print(f"megatron_rl: {KEY} episode of row {ep.index} (sample {ep.sample}) ran past "
                      f"job.episode_timeout_s={self.episode_timeout_s:g} s: counted as a failed sample "
                      "(rollout/failed_samples), the step goes on", flush=True)

    def _sample(self, ep: Episode) -> Sample:
        """The episode whole, for samples.jsonl and TensorBoard (``conversation.py: episode_sample``)."""
        conversation = ep.conversation
        return episode_sample(conversation.turns if conversation else [], self.tokenizer,
                              reward=None if ep.end == "failed" else sum(ep.rewards), row=ep.index, error=ep.error,
                              end=ep.end, first_prompt_ids=conversation.prompt_ids if conversation else ())

    def _rows(self, ep: Episode) -> list[dict]:
        """The episode's step-wise rows, one per turn (a failed one's reward: 0; they are dropped or masked);
        none for a failed episode that played no turn."""
        if ep.conversation is None or not ep.conversation.turns:
            assert ep.end == "failed", "every episode that did not fail played a turn"
            return []
        reward = 0.0 if ep.end == "failed" else sum(ep.rewards)
        return trajectory_rows(ep.conversation.turns, reward=reward, uid=ep.uid, trajectory_id=(ep.uid, ep.sample))

    def _start(self, ep: Episode) -> None:
        try:
            ep.env = self._timed(ep, "__init__(**row)", lambda: self.user.new(ep.row))
            first, images = self._timed(ep, "reset()", lambda: self.user.reset(ep.env))
            row_images = self.images.row_images(dict(ep.row)) if self.images is not None else []
            ep.conversation = Conversation(self.tokenizer, first, images=self.images,
                                           first_images=[*row_images, *images])
        except ImageError as err:
            return self._fail(ep, f"{self.user.name}.reset(): the first prompt's images{self._column()}: {err}", err)
        except (EpisodeError, ValueError) as err:
            return self._fail(ep, str(err), err)
        if len(ep.conversation.prompt_ids) > self.max_prompt_tokens:
            self._fail(ep, f"{self.user.name}.reset(): the first prompt has {len(ep.conversation.prompt_ids)} "
                           f"tokens, more than {self.max_prompt_tokens} (data.max_prompt_tokens, else the model's "
                           "context minus job.max_new_tokens)")

    def _advance(self, ep: Episode, completion: Completion, *, last_turn: bool) -> None:
        conversation = ep.conversation
        assert conversation is not None
        text = conversation.add_response(completion.token_ids, completion.logprobs, completion.finish_reason,
                                         completion.extra)
        try:
            result = self._timed(ep, "step(response)", lambda: self.user.step(ep.env, text))
            ep.rewards.append(result.reward)
            if result.done or last_turn:
                ep.end = "done" if result.done else "max_turns"
                return
            conversation.add_observation(result.observation, result.images)
        except EpisodeError as err:
            return self._fail(ep, str(err), err)
        except ImageError as err:
            return self._fail(ep, f"{self.user.name}.step(response): the next prompt's images cannot be used: {err}",
                              err)
        except ValueError as err:  # messages without a chat template
            return self._fail(ep, f"{self.user.name}.step(response) returned an observation that cannot be "
                                  f"rendered: {err}", err)
        if len(conversation.prompt_ids) > self.max_prompt_tokens:
            ep.end = "context"

    def _column(self) -> str:
        """Where the first prompt's images come from, beside ``reset()``."""
        key = self.images.image_key if self.images is not None else None
        return f" (column {key!r} and reset()'s)" if key else ""

    def _fail(self, ep: Episode, message: str, raised: BaseException | None = None) -> None:
        ep.end, ep.error, ep.raised = "failed", message, raised

    def random_baseline(self, seed: int) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.load_state_dict(state)


def episode_failures(episodes: list[Episode]) -> list[SampleFailure]:
    """The failed episodes, for the job's one line (``environments/failures.py``)."""
    return [failure(i, ep.index, ep.error, raised=ep.raised) for i, ep in enumerate(episodes) if ep.end == "failed"]


def episode_metrics(finished: list[Episode]) -> dict[str, float]:
    """Per episode: turns, new steps (turns whose prompt the template rewrote), why it ended; per turn t
    (1-based): the mean reward and reply length over the episodes that reached it."""
    count = max(len(finished), 1)
    metrics = {"episode/turns_mean": sum(len(ep.rewards) for ep in finished) / count,
               "episode/new_steps_mean": sum(ep.conversation.new_steps for ep in finished) / count}
    for reason in END_REASONS:
        metrics[f"episode/ended_{reason}"] = float(sum(ep.end == reason for ep in finished))
    for t in range(max((len(ep.rewards) for ep in finished), default=0)):
        reached = [ep for ep in finished if len(ep.rewards) > t]
        metrics[f"episode/turn_{t + 1}/reward_mean"] = sum(ep.rewards[t] for ep in reached) / len(reached)
        metrics[f"episode/turn_{t + 1}/response_tokens_mean"] = sum(
            len(ep.conversation.turns[t].response_ids) for ep in reached) / len(reached)
    return metrics
