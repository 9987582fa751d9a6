"""The digit game behind the Environment protocol: rollouts equal playing the game directly, evaluation with
an oracle passes every game, and the random baseline is the uniform policy's."""

from __future__ import annotations

import random

from megatron_rl.environments.next_digit.config import NextDigitConfig
from megatron_rl.environments.next_digit.environment import NextDigitEnvironment
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, play_episodes
from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs
from megatron_rl.inference.engine import SamplingSpec

import torch


def oracle(env: NextDigitEnvironment):
    tok, game = env.tokenizer, env.game

    def next_token_logprobs(contexts):
        out = torch.full((len(contexts), tok.vocab_size), -20.0)
        for row, context in enumerate(contexts):
            if context[-1] == tok.ask_token_id:
                out[row, tok.digit_id(game.target_digit(tok.id_to_digit(context[-2])))] = 0.0
            else:
                out[row, tok.eos_token_id] = 0.0
        return torch.log_softmax(out, -1)

    return next_token_logprobs


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
    result = env.evaluate(BuiltinEngine(oracle(env)), greedy, seed=0, num_prompts=None, pass_threshold=1.0)
    assert result.metrics == {"eval/reward_mean": 1.0, "eval/pass_rate": 1.0}
    assert result.samples[0].reward == 1.0 and result.samples[0].prompt.startswith("<bos>")
    assert 0.0 < env.random_baseline(0) < 0.1
