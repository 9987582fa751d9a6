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
returned the wrong shape is left out (``failures.py``); a batch where every episode failed stops the run.

Determinism (the contract of ``base.py``): rows come from ``PromptOrder`` (its ``consumed`` is the checkpointed
state), replies from the engine with the step's seed, so episodes are a function of (seed, step) as long as the
class is a function of its row and the replies (a class that draws random numbers seeds them from its row).
Every rank runs the same episodes (the engine is collective).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.environments.base import Evaluation, Rollouts, pass_metrics
from megatron_rl.environments.conversation import Conversation, has_chat_template, trajectory_rows
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.single_turn.data import PromptOrder, read_rows
from megatron_rl.environments.step_api.failures import METRIC as FAILED, FailedEpisodes
from megatron_rl.environments.step_api.user_class import EpisodeError, UserClass
from megatron_rl.inference.engine import Completion, RolloutEngine, SamplingSpec

END_REASONS = ("done", "max_turns", "context")


@dataclass
class Episode:
    row: Mapping[str, Any]
    uid: int
    sample: int
    env: Any = None
    conversation: Conversation | None = None
    rewards: list[float] = field(default_factory=list)
    """The reward of each turn (``step``'s); the episode's reward is their sum."""
    end: str | None = None
    """Why it ended: one of ``END_REASONS``, or 'failed'; None while it runs."""


class StepApiEnvironment:
    def __init__(self, spec: str, data: DataConfig, tokenizer: Any, *, seed: int, max_turns: int,
                 max_prompt_tokens: int) -> None:
        from megatron_rl.hf.tokenizer import pad_token_id, stop_token_ids

        self.user = UserClass(spec)
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id(tokenizer)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self.train = read_rows(data.paths("train_files"), "data.train_files")
        self.val = read_rows(data.paths("val_files"), "data.val_files") if data.paths("val_files") else None
        self.user.check_on_row(self.train[0], tokenizer, "row 0 of data.train_files")
        self.order = PromptOrder(len(self.train), seed=seed, shuffle=data.shuffle)
        self.max_turns, self.max_prompt_tokens = max_turns, max_prompt_tokens
        self.failures = FailedEpisodes()

    def describe(self) -> str:
        """One line for the log: the class, the rows, how text is rendered, the limits."""
        rows = f"train: {len(self.train)} rows" + (f"; val: {len(self.val)} rows" if self.val else "")
        text = ("the tokenizer's chat template (strings are user messages)" if has_chat_template(self.tokenizer)
                else "raw text (the tokenizer has no chat template)")
        return (f"step-API environment {self.user.name} ({self.user.spec}): {rows}; {text}; at most "
                f"{self.max_turns} turns (job.max_turns) and {self.max_prompt_tokens} prompt tokens per turn")

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        assert step_wise, "JobConfig checks that a step-API environment trains step-wise"
        rows = [self.train[i] for i in self.order.next(num_prompts)]
        episodes = [Episode(row, uid, k) for uid, row in enumerate(rows) for k in range(n_samples_per_prompt)]
        finished = self.play(episodes, engine, spec, seed, "the step's rollouts")
        out_rows = [row for ep in finished for row in trajectory_rows(
            ep.conversation.turns, reward=sum(ep.rewards), uid=ep.uid, trajectory_id=(ep.uid, ep.sample))]
        output = {name: [row[name] for row in out_rows] for name in out_rows[0]}
        metrics = episode_metrics(finished)
        metrics[FAILED] = float(self.failures.count)
        metrics["data/epoch"] = float(self.order.epoch)
        return Rollouts(output, metrics)  # type: ignore[arg-type]

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        if self.val is None:
            return Evaluation({})
        rows = self.val[:num_prompts] if num_prompts else self.val
        finished = self.play([Episode(row, uid, 0) for uid, row in enumerate(rows)], engine, spec, seed,
                             "an evaluation")
        metrics = pass_metrics([sum(ep.rewards) for ep in finished], pass_threshold)
        metrics["eval/failed_samples"] = float(self.failures.count)
        return Evaluation(metrics)

    def play(self, episodes: list[Episode], engine: RolloutEngine, spec: SamplingSpec, seed: int,
             what: str) -> list[Episode]:
        """Run ``episodes`` turn by turn, one ``engine.generate`` call per turn over the running ones (every
        call with ``seed``: the built-in engine continues one stream); returns those that did not fail."""
        self.failures.start_batch()
        for ep in episodes:
            self._start(ep)
        for turn in range(self.max_turns):
            running = [ep for ep in episodes if ep.end is None]
            if not running:
                break
            completions = engine.generate([ep.conversation.prompt_ids for ep in running], spec, seed=seed)
            for ep, completion in zip(running, completions):
                self._advance(ep, completion, last_turn=turn == self.max_turns - 1)
        finished = [ep for ep in episodes if ep.end != "failed"]
        self.failures.check_some_finished(len(finished), what)
        return finished

    def _start(self, ep: Episode) -> None:
        try:
            ep.env = self.user.new(ep.row)
            ep.conversation = Conversation(self.tokenizer, self.user.reset(ep.env))
        except (EpisodeError, ValueError) as err:
            return self._fail(ep, str(err))
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
            result = self.user.step(ep.env, text)
            ep.rewards.append(result.reward)
            if result.done or last_turn:
                ep.end = "done" if result.done else "max_turns"
                return
            conversation.add_observation(result.observation)
        except EpisodeError as err:
            return self._fail(ep, str(err))
        except ValueError as err:  # messages without a chat template
            return self._fail(ep, f"{self.user.name}.step(response) returned an observation that cannot be "
                                  f"rendered: {err}")
        if len(conversation.prompt_ids) > self.max_prompt_tokens:
            ep.end = "context"

    def _fail(self, ep: Episode, message: str) -> None:
        ep.end = "failed"
        self.failures.record(message)

    def random_baseline(self, seed: int) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.order.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.consumed = int(state.get("consumed", 0))


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
