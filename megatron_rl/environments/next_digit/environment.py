"""The next-digit game as an ``Environment`` (``environments/base.py``): multi-turn, its own vocabulary.

Place in the data flow: ``job/main.py`` -> ``NextDigitEnvironment.rollout`` -> ``rollout.play_episodes`` (game
turns through the rollout engine) -> ``episodes_to_generator_output`` -> ``Trainer.train_step``.

Games are drawn from ``random.Random(seed)`` where ``seed`` is the step's rollout seed, so the environment has no
position in any data to save: ``state_dict`` is empty. Evaluation plays ``next_digit.eval_games`` fixed games
(drawn from the run's seed, the same games at every evaluation).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from megatron_rl.environments.base import Evaluation, Rollouts, Sample, pass_metrics
from megatron_rl.environments.next_digit.config import NextDigitConfig
from megatron_rl.environments.next_digit.game import NextDigitGame
from megatron_rl.environments.next_digit.rollout import (
    PlayedEpisode,
    episodes_to_generator_output,
    mean_reward,
    play_episodes,
)
from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer
from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs
from megatron_rl.inference.engine import RolloutEngine, SamplingSpec

EVAL_SEED_OFFSET = 7_777_777
"""Eval games come from ``random.Random(seed + EVAL_SEED_OFFSET)``: disjoint from the training steps' streams."""
SAMPLES_PER_STEP = 8
"""Decoded episodes handed to the job per step (one per game; the job keeps ``logging.num_samples``)."""


class NextDigitEnvironment:
    def __init__(self, config: NextDigitConfig, *, max_new_tokens: int) -> None:
        self.tokenizer = DigitTokenizer()
        self.game = NextDigitGame(self.tokenizer, num_turns=config.num_turns, offset=config.digit_offset)
        self.config = config
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = self.tokenizer.pad_token_id
        self.stop_token_ids = (self.tokenizer.eos_token_id,)

    def rollout(self, engine: RolloutEngine, spec: SamplingSpec, *, num_prompts: int, n_samples_per_prompt: int,
                seed: int, step_wise: bool) -> Rollouts:
        played = play_episodes(self.game, engine, spec, num_prompts=num_prompts,
                               n_samples_per_prompt=n_samples_per_prompt, rng=random.Random(seed), seed=seed)
        return Rollouts(episodes_to_generator_output(played, step_wise=step_wise),
                        samples=self.samples(played[::n_samples_per_prompt][:SAMPLES_PER_STEP]))

    def samples(self, played: list[PlayedEpisode]) -> list[Sample]:
        """Decoded episodes: the first prompt, then every response and observation in order."""
        decode = self.tokenizer.decode
        return [Sample(prompt=decode(p.episode.prompts[0]),
                       response=decode(episodes_to_generator_output([p], step_wise=False)["response_ids"][0]),
                       reward=p.episode.reward) for p in played]

    def evaluate(self, engine: RolloutEngine, spec: SamplingSpec, *, seed: int, num_prompts: int | None,
                 pass_threshold: float) -> Evaluation:
        games = num_prompts or self.config.eval_games
        played = play_episodes(self.game, engine, spec, num_prompts=games, n_samples_per_prompt=1,
                               rng=random.Random(seed + EVAL_SEED_OFFSET), seed=seed + EVAL_SEED_OFFSET)
        return Evaluation(pass_metrics([p.episode.reward for p in played], pass_threshold),
                          samples=self.samples(played[:SAMPLES_PER_STEP]))

    def random_baseline(self, seed: int) -> float | None:
        """Mean reward of a uniformly random policy over ``next_digit.baseline_episodes`` games (no model)."""
        episodes = max(1, self.config.baseline_episodes)
        engine = BuiltinEngine(uniform_next_token_logprobs(self.tokenizer.vocab_size))
        spec = SamplingSpec(max_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids)
        played = play_episodes(self.game, engine, spec, num_prompts=episodes, n_samples_per_prompt=1,
                               rng=random.Random(seed), seed=seed * 1_000_003 - 1)
        return mean_reward(played)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
