"""Prompts from a file, one response each, scored by the user's reward function: the ``single_turn`` environment.

Place in the data flow: ``job/main.py`` -> ``SingleTurnEnvironment.rollout``::

    PromptOrder.next (seeded, checkpointed)  ->  engine.generate (n samples per prompt)  ->  decode
      ->  reward function (prompt text, response text, other columns)  ->  GeneratorOutput  ->  Trainer.train_step

Everything a user can get wrong (files, prompt column, chat template, reward function) is checked in the
constructor, on every rank, before any process group exists (``ConfigError`` naming the key). The tokenizer is
the one of ``model.hf_path``; responses are decoded without special tokens (the eos that ended them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.environments.base import Rollouts, pass_metrics
from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
from megatron_rl.environments.single_turn.data import Prompt, PromptOrder, Prompts, read_rows, tokenize_rows
from megatron_rl.environments.single_turn.reward import check_reward_function, load_reward_function, score
from megatron_rl.inference.engine import Completion, RolloutEngine, SamplingSpec


class SingleTurnEnvironment:
    def __init__(self, data: DataConfig, reward: RewardConfig, tokenizer: Any, *, seed: int,
                 max_prompt_tokens: int) -> None:
        from megatron_rl.hf.tokenizer import pad_token_id

        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("model.hf_path: the tokenizer has no eos token, so responses could not stop; set "
                             "eos_token in its tokenizer_config.json")
        self.stop_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        self.train = self._prompts(data, "train_files", max_prompt_tokens)
        self.val = self._prompts(data, "val_files", max_prompt_tokens) if data.paths("val_files") else None
        self.reward_spec = reward.function or ""
        self.reward_fn = load_reward_function(reward.function)
        first = self.train.kept[0]
        check_reward_function(self.reward_fn, self.reward_spec, prompt=first.text, extra=first.extra)
        self.order = PromptOrder(len(self.train.kept), seed=seed, shuffle=data.shuffle)
        self.max_prompt_tokens = max_prompt_tokens

    def _prompts(self, data: DataConfig, which: str, max_prompt_tokens: int) -> Prompts:
        key = f"data.{which}"
        rows = read_rows(data.paths(which), key)
        return tokenize_rows(rows, self.tokenizer, prompt_key=data.prompt_key, max_prompt_tokens=max_prompt_tokens,
                             files_key=key)

    def describe(self) -> str:
        """One line for the log: rows kept and skipped per split, the limit, the reward function."""
        parts = [f"{name}: {len(p.kept)} prompts" + (f", {p.skipped} skipped (longer than {self.max_prompt_tokens} "
                                                      "tokens: data.max_prompt_tokens)" if p.skipped else "")
                 for name, p in (("train", self.train), ("val", self.val)) if p is not None]
        return f"single_turn: {'; '.join(parts)}; reward {self.reward_spec}"

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        prompts = [self.train.kept[i] for i in self.order.next(num_prompts)]
        repeated = [p for p in prompts for _ in range(n_samples_per_prompt)]  # a group's rows are contiguous
        completions = engine.generate([p.token_ids for p in repeated], spec, seed=seed)
        rewards, reward_metrics = self._score(repeated, completions)
        output = {
            "prompt_token_ids": [p.token_ids for p in repeated],
            "response_ids": [c.token_ids for c in completions],
            "rewards": rewards,
            "loss_masks": [[1] * len(c.token_ids) for c in completions],
            "uids": [i // n_samples_per_prompt for i in range(len(repeated))],
            "rollout_logprobs": [c.logprobs for c in completions],
            "trajectory_ids": [(i // n_samples_per_prompt, i % n_samples_per_prompt) for i in range(len(repeated))],
            "is_last_step": [True] * len(repeated),
            "stop_reasons": [c.finish_reason for c in completions],
        }
        if all("routed_experts" in c.extra for c in completions):  # MoE routing replay R3 (builtin_engine.py)
            output["routed_experts"] = [c.extra["routed_experts"] for c in completions]
        metrics = {f"reward_fn/{k}": v for k, v in reward_metrics.items()}
        metrics["data/epoch"] = float(self.order.epoch)
        return Rollouts(output, metrics)  # type: ignore[arg-type]

    def _score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]
               ) -> tuple[list[float], dict[str, float]]:
        """Rewards per response and the means of the reward function's extra metrics."""
        rewards, sums = [], {}
        for prompt, completion in zip(prompts, completions):
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            reward, metrics = score(self.reward_fn, self.reward_spec, prompt=prompt.text, response=text,
                                    extra=prompt.extra)
            rewards.append(reward)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        return rewards, {k: v / len(prompts) for k, v in sums.items()}

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> dict[str, float]:
        if self.val is None:
            return {}
        prompts = self.val.kept[:num_prompts] if num_prompts else self.val.kept
        completions = engine.generate([p.token_ids for p in prompts], spec, seed=seed)
        rewards, _ = self._score(prompts, completions)
        return pass_metrics(rewards, pass_threshold)

    def random_baseline(self, seed: int) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.order.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.consumed = int(state.get("consumed", 0))
