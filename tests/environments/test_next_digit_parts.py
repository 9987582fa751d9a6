"""Demo building blocks without Megatron: tokenizer, game, sampler, rollout layouts, reporting."""

from __future__ import annotations

import json
import random

import pytest
import torch

from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.environments.next_digit.game import NextDigitGame
from megatron_rl.job.reporting import RunReporter, WallTimes, read_metrics, summary_paragraph, truncate_metrics
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, mean_reward, observation_after, play_episodes
from megatron_rl.inference.builtin_engine import (
    SamplingParams,
    sample_next_tokens,
    sample_responses,
    sampling_generator,
    uniform_next_token_logprobs,
)
from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer
from megatron_rl.inference.builtin_engine import BuiltinEngine, rollout_seed

TOK = DigitTokenizer()


def fixed_policy(table: torch.Tensor):
    """Next-token log-probs depend on the last token only (a bigram table [V, V])."""
    def next_token_logprobs(contexts):
        return torch.log_softmax(table[torch.tensor([c[-1] for c in contexts])], -1)
    return next_token_logprobs


def oracle_policy(game: NextDigitGame):
    """Always answers right: after '?' the shown digit + offset, after a digit the stop token."""
    def next_token_logprobs(contexts):
        out = torch.full((len(contexts), TOK.vocab_size), -1e9)
        for i, c in enumerate(contexts):
            if c[-1] == TOK.ask_token_id:
                out[i, TOK.digit_id(game.target_digit(TOK.id_to_digit(c[-2])))] = 0.0
            else:
                out[i, TOK.eos_token_id] = 0.0
        return torch.log_softmax(out, -1)
    return next_token_logprobs


def test_tokenizer_round_trip_and_errors() -> None:
    ids = TOK.encode(["<bos>", "7", "?", "8", "<eos>"])
    assert TOK.decode(ids) == "<bos> 7 ? 8 <eos>"
    assert [TOK.id_to_digit(i) for i in ids] == [None, 7, None, 8, None]
    assert TOK.vocab_size == 16 and len(set(TOK.tokens)) == 16
    with pytest.raises(ValueError, match="unknown next-digit symbols"):
        TOK.encode(["x"])


def test_game_prompts_extend_and_scores() -> None:
    game = NextDigitGame(TOK, num_turns=3, offset=1)
    ep = game.new_episode(random.Random(0))
    answers = [[TOK.digit_id((ep.digits[0] + 1) % 10), TOK.eos_token_id],  # exact: 1.0
               [TOK.digit_id((ep.digits[1] + 1) % 10), TOK.ask_token_id, TOK.ask_token_id],  # right digit: 0.5
               [TOK.eos_token_id]]  # wrong: 0
    for answer in answers:
        game.step(ep, answer)
    assert ep.done and ep.scores == [1.0, 0.5, 0.0] and ep.reward == pytest.approx(0.5)
    for t in range(2):  # each prompt = previous prompt + response + (feedback, next digit, ?)
        obs = observation_after(ep, t)
        assert ep.prompts[t + 1] == ep.prompts[t] + ep.responses[t] + obs
        assert obs[1:] == [TOK.digit_id(ep.digits[t + 1]), TOK.ask_token_id]
    assert observation_after(ep, 0)[0] == TOK.correct_token_id and observation_after(ep, 1)[0] == TOK.wrong_token_id
    with pytest.raises(ValueError, match="num_turns"):
        NextDigitGame(TOK, num_turns=0)


def test_sample_next_tokens_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logprobs = torch.log(probs).expand(20000, 4)
    tokens, token_lp = sample_next_tokens(logprobs, 1.0, sampling_generator(0, 0))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.015)
    assert torch.allclose(token_lp, torch.log(probs)[tokens])
    # temperature 2: sampled from softmax(log p / 2), and that distribution's log-probs are recorded
    tokens, token_lp = sample_next_tokens(logprobs, 2.0, sampling_generator(0, 1))
    tempered = torch.sqrt(probs) / torch.sqrt(probs).sum()
    assert torch.allclose(torch.bincount(tokens, minlength=4).float() / len(tokens), tempered, atol=0.015)
    assert torch.allclose(token_lp, torch.log(tempered)[tokens], atol=1e-6)
    greedy, greedy_lp = sample_next_tokens(logprobs[:3], 0.0, sampling_generator(0, 2))
    assert greedy.tolist() == [0, 0, 0] and torch.allclose(greedy_lp, torch.log(probs[:1]).expand(3))


def test_sample_responses_stop_length_determinism() -> None:
    table = torch.randn(TOK.vocab_size, TOK.vocab_size, generator=torch.Generator().manual_seed(0))
    table[:, TOK.eos_token_id] += 1.5  # stop often
    policy = fixed_policy(table)
    prompts = [[TOK.bos_token_id, TOK.digit_id(d), TOK.ask_token_id] for d in range(10)] * 5
    params = SamplingParams(max_new_tokens=4, stop_token_id=TOK.eos_token_id)
    a = sample_responses(policy, prompts, params, sampling_generator(3, 7))
    b = sample_responses(policy, prompts, params, sampling_generator(3, 7))
    assert a == b  # same (seed, step) on every rank -> the same tokens
    assert a != sample_responses(policy, prompts, params, sampling_generator(3, 8))
    for prompt, response, lps, reason in zip(prompts, a.responses, a.logprobs, a.stop_reasons):
        assert 1 <= len(response) <= 4 and len(lps) == len(response)
        assert (reason == "stop") == (response[-1] == TOK.eos_token_id)
        assert TOK.eos_token_id not in response[:-1]
        if reason == "length":
            assert len(response) == 4
        context = prompt + response  # the recorded log-probs are the policy's (temperature 1)
        expected = [float(torch.log_softmax(table[context[j - 1]], -1)[context[j]])
                    for j in range(len(prompt), len(context))]
        assert lps == pytest.approx(expected, abs=1e-6)
    assert {"stop", "length"} <= set(a.stop_reasons)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0, stop_token_id=2)


def test_rollout_layouts_validate_and_merge_to_trajectories() -> None:
    game = NextDigitGame(TOK, num_turns=3)
    table = torch.randn(TOK.vocab_size, TOK.vocab_size, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_new_tokens=3, stop_token_id=TOK.eos_token_id)
    played = play_episodes(game, BuiltinEngine(fixed_policy(table)), params.to_spec(), num_prompts=3,
                           n_samples_per_prompt=2, rng=random.Random(0), seed=rollout_seed(0, 0))
    assert [p.uid for p in played] == [0, 0, 1, 1, 2, 2]
    assert played[0].episode.digits == played[1].episode.digits  # a group plays one game
    step_wise = episodes_to_generator_output(played, step_wise=True)
    trajectory = episodes_to_generator_output(played, step_wise=False)
    validate_generator_output(step_wise, step_wise=True)
    validate_generator_output(trajectory, step_wise=False)
    assert len(step_wise["prompt_token_ids"]) == 18 and len(trajectory["prompt_token_ids"]) == 6
    assert step_wise["rewards"][2::3] == [p.episode.reward for p in played]
    assert all(r == 0.0 for i, r in enumerate(step_wise["rewards"]) if i % 3 != 2)
    # prefix merging of the step-wise layout gives exactly the trajectory layout
    merged, counts = merge_stepwise_output(step_wise)
    assert counts == {"num_seq_before_merge": 18, "num_seq_after_merge": 6}
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "uids", "rewards"):
        assert merged[key] == trajectory[key], key
    flat = [[lp for row in out["rollout_logprobs"] for lp in row] for out in (merged, trajectory)]
    assert flat[0] == pytest.approx(flat[1])


def test_oracle_scores_one_uniform_scores_baseline() -> None:
    game = NextDigitGame(TOK, num_turns=3)
    params = SamplingParams(max_new_tokens=3, stop_token_id=TOK.eos_token_id)
    kwargs = dict(num_prompts=50, n_samples_per_prompt=4, rng=random.Random(0), seed=rollout_seed(0, 0))
    assert mean_reward(play_episodes(game, BuiltinEngine(oracle_policy(game)), params.to_spec(), **kwargs)) == 1.0
    uniform_engine = BuiltinEngine(uniform_next_token_logprobs(TOK.vocab_size))
    uniform = mean_reward(play_episodes(game, uniform_engine, params.to_spec(), **kwargs))
    # exact expectation for a uniform policy: 0.5 * P(first right) + 0.5 * P(right, then stop) = 0.5/16 + 0.5/256
    assert uniform == pytest.approx(0.5 / 16 + 0.5 / 256, abs=0.02)


def test_reporter_files_plot_summary_and_resume(tmp_path) -> None:
    rep = RunReporter(tmp_path, total_steps=4, progress_bar=False)
    for step in range(1, 5):
        rep.log_step(step, {"reward/mean": 0.1 * step, "policy/loss": -0.01 * step})
    summary = rep.finish(baseline=0.03, times=WallTimes(1.0, 12.0, 13.0))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (tmp_path / "reward_loss.png").stat().st_size > 1000
    assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
    assert "0.030" in summary and (tmp_path / "summary.txt").read_text().strip() == summary
    # resuming from step 2 drops the later rows (they will be logged again), a torn last line is ignored
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')
    truncate_metrics(tmp_path / "metrics.jsonl", last_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


def test_summary_windows() -> None:
    rows = [{"step": s, "reward/mean": r} for s, r in enumerate([0.0, 0.1, 0.8, 0.9], start=1)]
    text = summary_paragraph(rows, baseline=0.03, times=WallTimes(1.0, 60.0, 61.0), window=2)
    assert "0.050" in text and "0.850" in text and "learned" in text


class TablePolicy:
    """``next_token_logprobs(sequences, attention_mask)`` of a bigram table, left-padded like MegatronPolicy."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.rows_seen: list[int] = []

    def next_token_logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert bool(attention_mask[:, -1].all())  # left-padded: every context ends in the last column
        self.rows_seen.append(len(sequences))
        return torch.log_softmax(self.table[sequences[:, -1]], -1)  # [n, V]


def test_policy_next_token_logprobs_is_the_full_distribution() -> None:
    from megatron_rl.inference.builtin_engine import policy_next_token_logprobs

    table = torch.randn(TOK.vocab_size, TOK.vocab_size, generator=torch.Generator().manual_seed(2))
    policy = TablePolicy(table)
    fn = policy_next_token_logprobs(policy, TOK.pad_token_id)
    contexts = [[1, 7, 3], [1, 7, 3], [1, 9, 3, 10, 2, 4, 12, 3], [5]]  # different lengths, one duplicate
    got = fn(contexts)
    expected = torch.log_softmax(table[torch.tensor([c[-1] for c in contexts])], -1)
    assert torch.allclose(got, expected, atol=1e-6)
    assert policy.rows_seen == [3]  # duplicates computed once


@pytest.mark.parametrize("num_turns, max_new_tokens", [(3, 3), (1, 1), (4, 6)])
def test_max_sequence_length_is_the_longest_rollout(num_turns: int, max_new_tokens: int) -> None:
    """``next_digit_longest_sequence`` (what the pre-flight checks) against real rollouts of a policy that
    never stops, so every response takes ``max_new_tokens``: the longest sequence of either layout."""
    from megatron_rl.job.config import next_digit_longest_sequence

    table = torch.zeros(TOK.vocab_size, TOK.vocab_size)
    table[:, TOK.eos_token_id] = -1e9
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_id=TOK.eos_token_id)
    played = play_episodes(NextDigitGame(TOK, num_turns=num_turns), BuiltinEngine(fixed_policy(table)),
                           params.to_spec(), num_prompts=2, n_samples_per_prompt=2, rng=random.Random(0),
                           seed=rollout_seed(0, 0))
    expected = next_digit_longest_sequence(num_turns, max_new_tokens)
    for step_wise in (True, False):
        out = episodes_to_generator_output(played, step_wise=step_wise)
        longest = max(len(p) + len(r) for p, r in zip(out["prompt_token_ids"], out["response_ids"]))
        assert longest == expected, step_wise
