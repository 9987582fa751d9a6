"""The digit game behind the Environment protocol: rollouts equal playing the game directly, evaluation with
an oracle passes every game, and the random baseline is the uniform policy's."""

from __future__ import annotations

import random

from megatron_rl.environments.next_digit.config import NextDigitConfig
from megatron_rl.environments.next_digit.environment import NextDigitEnvironment
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, play_episodes
from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs
from megatron_rl.inference.engine import SamplingSpec
from tests.environments.test_next_digit_parts import oracle_policy


def test_rollout_is_the_game_played_through_the_engine():
    env = NextDigitEnvironment(NextDigitConfig(num_turns=2), max_new_tokens=3)
    spec = SamplingSpec(max_tokens=3, stop_token_ids=env.stop_token_ids)
    uniform = uniform_next_token_logprobs(env.tokenizer.vocab_size)
    got = env.rollout(BuiltinEngine(uniform), spec, num_prompts=3, n_samples_per_prompt=2, seed=5, step_wise=True)
    played = play_episodes(env.game, BuiltinEngine(uniform), spec, num_prompts=3, n_samples_per_prompt=2,
                           rng=random.Random(5), seed=5)
    assert got.output == episodes_to_generator_output(played, step_wise=True) and env.state_dict() == {}


def test_evaluation_and_baseline():
    env = NextDigitEnvironment(NextDigitConfig(eval_games=20, baseline_episodes=300), max_new_tokens=3)
    greedy = SamplingSpec(max_tokens=3, temperature=0.0, stop_token_ids=env.stop_token_ids)
    result = env.evaluate(BuiltinEngine(oracle_policy(env.game)), greedy, seed=0, num_prompts=None, pass_threshold=1.0)
    assert result.metrics == {"eval/reward_mean": 1.0, "eval/pass_rate": 1.0}
    assert result.samples[0].reward == 1.0 and result.samples[0].prompt.startswith("<bos>")
    assert 0.0 < env.random_baseline(0) < 0.1
