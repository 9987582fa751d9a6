"""Prompts from a file, one response each, scored by the user's reward function: the ``single_turn`` environment.

Place in the data flow: ``job/main.py`` -> ``SingleTurnEnvironment.rollout``::

    PromptOrder.next (seeded, checkpointed)  ->  engine.generate (n samples per prompt)  ->  decode
      ->  reward function (prompt text, response text, other columns)  ->  GeneratorOutput  ->  Trainer.train_step

Everything a user can get wrong (files, prompt column, chat template, reward function) is checked in the
constructor, on every rank, before any process group exists (``ConfigError`` naming the key); the pre-flight
builds the same environment before torchrun. The tokenizer is the one of ``model.hf_path``; responses are
decoded without special tokens (the eos that ended them) and capped at what the context leaves after the
longest kept prompt. A reward function that raises (or returns a non-number) on one row fails that sample
only: it is left out of training (``environments/failures.py``), counted as ``rollout/failed_samples``, and
the job prints the first such failure once; a step where every sample failed stops the run
(``AllSamplesFailed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.environments.base import Evaluation, Rollouts, Sample, pass_metrics
from megatron_rl.environments.failures import AllSamplesFailed, SampleFailure, drop_failed_samples, failure
from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
from megatron_rl.environments.single_turn.data import Prompt, PromptOrder, Prompts, read_rows, tokenize_rows
from megatron_rl.environments.single_turn.images import Images, PromptImages
from megatron_rl.environments.single_turn.reward import check_reward_function, load_reward_function, score
from megatron_rl.inference.engine import Completion, RolloutEngine, SamplingSpec


class SingleTurnEnvironment:
    def __init__(self, data: DataConfig, reward: RewardConfig, tokenizer: Any, *, seed: int,
                 max_prompt_tokens: int, context: int | None = None, max_rows: int | None = None,
                 teacher_of: Callable[[Mapping[str, Any]], int] | None = None,
                 images: PromptImages | None = None) -> None:
        """``max_rows``: read only the first rows of each file (the pre-flight's quick check). ``teacher_of``:
        a prompt row's columns -> its distillation teacher (``distillation/routing.py: router``), written to
        ``GeneratorOutput['teacher_ids']``; None: no routing. ``reward.function`` unset: every reward is 0
        (pure distillation; the job config allows it only under ``distillation.teachers``). ``images``: the
        prompts carry images (``data.image_key``; ``images.py``)."""
        from megatron_rl.hf.tokenizer import pad_token_id, stop_token_ids

        self.tokenizer = tokenizer
        self.images = images
        self.pad_token_id = pad_token_id(tokenizer)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self.train = self._prompts(data, "train_files", max_prompt_tokens, max_rows)
        self.val = self._prompts(data, "val_files", max_prompt_tokens, max_rows) if data.paths("val_files") else None
        self.reward_spec = reward.function or ""
        self.reward_fn = load_reward_function(reward.function) if reward.function else no_reward
        first = self.train.kept[0]
        check_reward_function(self.reward_fn, self.reward_spec, prompt=first.text, extra=first.extra)
        self.teacher_of = teacher_of
        self.order = PromptOrder(len(self.train.kept), seed=seed, shuffle=data.shuffle)
        self.max_prompt_tokens = max_prompt_tokens
        longest = max(len(p.token_ids) for split in (self.train, self.val) if split is not None for p in split.kept)
        self.max_response_tokens = None if context is None else context - longest
        """What the context leaves after the longest kept prompt: caps ``job.max_new_tokens`` (None: no cap)."""

    def _prompts(self, data: DataConfig, which: str, max_prompt_tokens: int, max_rows: int | None) -> Prompts:
        key = f"data.{which}"
        rows = read_rows(data.paths(which), key, max_rows=max_rows)
        tokenize = tokenize_rows if self.images is None else self.images.tokenize
        return tokenize(rows, self.tokenizer, prompt_key=data.prompt_key, max_prompt_tokens=max_prompt_tokens,
                        files_key=key)

    def describe(self) -> str:
        """One line for the log: rows kept and skipped per split, the limit, the reward function."""
        parts = [f"{name}: {len(p.kept)} prompts" + (f", {p.skipped} skipped (longer than {self.max_prompt_tokens} "
                                                      "tokens: data.max_prompt_tokens)" if p.skipped else "")
                 for name, p in (("train", self.train), ("val", self.val)) if p is not None]
        parts += [f"{len(p.failed)} {name} rows left out (images that cannot be read; first: {p.failed[0][1]})"
                  for name, p in (("train", self.train), ("val", self.val)) if p is not None and p.failed]
        cap = f"; responses up to {self.max_response_tokens} tokens (what the context leaves)" \
            if self.max_response_tokens is not None else ""
        reward = self.reward_spec or "none (every reward 0: pure distillation)"
        return f"single_turn: {'; '.join(parts)}; reward {reward}{cap}"

    def _generate(self, engine: RolloutEngine, prompts: Sequence[Prompt], spec: SamplingSpec, seed: int,
                  images: Sequence[Images] | None = None) -> list[Completion]:
        """``engine.generate`` with ``spec.max_tokens`` capped by what the context leaves (``images``: per prompt,
        for the built-in engine)."""
        if self.max_response_tokens is not None and spec.max_tokens > self.max_response_tokens:
            spec = dataclasses.replace(spec, max_tokens=self.max_response_tokens)
        if images is not None:
            return engine.generate([p.token_ids for p in prompts], spec, seed=seed, images=images)  # type: ignore
        return engine.generate([p.token_ids for p in prompts], spec, seed=seed)

    def _images(self, prompts: Sequence[Prompt], repeats: int = 1) -> list[Images] | None:
        """Each prompt's images (``repeats`` times: a group's samples share one list), None without images."""
        if self.images is None:
            return None
        return [images for p in prompts for images in [self.images.images(p)] * repeats]

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        prompts = [self.train.kept[i] for i in self.order.next(num_prompts)]
        repeated = [p for p in prompts for _ in range(n_samples_per_prompt)]  # a group's rows are contiguous
        images = self._images(prompts, n_samples_per_prompt)
        completions = self._generate(engine, repeated, spec, seed, images)
        scored = self._score(repeated, completions)
        output = {
            "prompt_token_ids": [p.token_ids for p in repeated],
            "response_ids": [c.token_ids for c in completions],
            "rewards": [0.0 if r is None else r for r in scored.rewards],  # failed ones: dropped just below
            "loss_masks": [[1] * len(c.token_ids) for c in completions],
            "uids": [i // n_samples_per_prompt for i in range(len(repeated))],
            "rollout_logprobs": [c.logprobs for c in completions],
            "trajectory_ids": [(i // n_samples_per_prompt, i % n_samples_per_prompt) for i in range(len(repeated))],
            "is_last_step": [True] * len(repeated),
            "stop_reasons": [c.finish_reason for c in completions],
        }
        if self.teacher_of is not None:  # on-policy distillation: each row's teacher by its prompt row's columns
            output["teacher_ids"] = [self.teacher_of(p.extra) for p in repeated]
        if images is not None:
            output["images"] = images
        if all("routed_experts" in c.extra for c in completions):  # MoE routing replay R3 (builtin_engine.py)
            output["routed_experts"] = [c.extra["routed_experts"] for c in completions]
        try:
            output, failure_metrics = drop_failed_samples(output, [r is None for r in scored.rewards])
        except AllSamplesFailed as err:
            raise AllSamplesFailed(f"{err}: every call of reward.function={self.reward_spec!r} raised; first: "
                                   f"{scored.failures[0].line('reward.function')}") from None
        metrics = {f"reward_fn/{k}": v for k, v in scored.metrics.items()}
        metrics.update(failure_metrics)
        metrics["data/epoch"] = float(self.order.epoch)
        if self.images is not None:
            metrics["data/failed_image_rows"] = float(len(self.train.failed))
        return Rollouts(output, metrics, samples=scored.samples[::n_samples_per_prompt],  # type: ignore[arg-type]
                        failures=scored.failures)

    def _score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> Scored:
        """Rewards per response (None where the reward function raised or returned a non-number: that row's
        failure, not the run's), the means of its extra metrics over the scored ones, and the decoded samples."""
        scored = Scored()
        sums: dict[str, float] = {}
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            try:
                reward, metrics = score(self.reward_fn, self.reward_spec, prompt=prompt.text, response=text,
                                        extra=prompt.extra)
            except Exception as err:  # noqa: BLE001 - any exception of the user's function fails this row only
                scored.failures.append(failure(index, prompt.row, err))
                reward, metrics = None, {}
            scored.rewards.append(reward)
            scored.samples.append(Sample(prompt.text, text, reward, row=prompt.row,
                                         error=scored.failures[-1].error if reward is None else None))
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        self._agree_on_failures(scored)
        ok = sum(r is not None for r in scored.rewards)
        scored.metrics = {k: v / ok for k, v in sums.items()} if ok else {}
        return scored

    def _agree_on_failures(self, scored: "Scored") -> None:
        """Collective: a response whose scoring failed on any rank fails on every rank (a reward function that
        raised on one rank only), so every rank trains on the same rows (a counted failure, not a disagreement)."""
        from megatron_rl.distributed.rank0 import union_over_ranks

        here = {i for i, r in enumerate(scored.rewards) if r is None}
        for i in sorted(union_over_ranks(here) - here):
            scored.rewards[i] = None
            scored.failures.append(SampleFailure(i, scored.samples[i].row, "reward.function failed on another rank "
                                                 "for this response (it is not a function of its arguments there)"))
            scored.samples[i] = dataclasses.replace(scored.samples[i], reward=None, error=scored.failures[-1].error)
        scored.failures.sort(key=lambda f: f.index)

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        if self.val is None:
            return Evaluation({})
        prompts = self.val.kept[:num_prompts] if num_prompts else self.val.kept
        scored = self._score(prompts, self._generate(engine, prompts, spec, seed, self._images(prompts)))
        return Evaluation(pass_metrics(scored.rewards, pass_threshold), scored.samples, scored.failures)

    def random_baseline(self, seed: int) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.load_state_dict(state)


def no_reward(**_: Any) -> float:
    """The reward when ``reward.function`` is unset (pure distillation): 0 for every response."""
    return 0.0


@dataclass
class Scored:
    """What scoring a list of responses gives (``SingleTurnEnvironment._score``)."""

    rewards: list[float | None] = field(default_factory=list)
    """One per response; None where scoring failed."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Means of the reward function's extra numbers over the scored responses."""
    samples: list[Sample] = field(default_factory=list)
    failures: list[SampleFailure] = field(default_factory=list)
