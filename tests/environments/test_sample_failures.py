"""Failed samples leave training without killing the run: ``environments/failures.py`` on hand-made rollouts,
and the single_turn environment with a reward function that raises on some rows."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.advantages import grpo_advantages
from megatron_rl.config import AlgorithmConfig as AlgorithmSettings
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.minibatch import compute_prompt_mini_batch_boundaries
from megatron_rl.environments.failures import (
    DROPPED_GROUPS,
    FAILED_SAMPLES,
    AllSamplesFailed,
    EpisodeRows,
    assemble_episodes,
    drop_failed_samples,
    failure,
)
from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment
from megatron_rl.inference.builtin_engine import BuiltinEngine
from megatron_rl.inference.engine import SamplingSpec

from tests.environments.test_single_turn import TRAIN, oracle_and_noise


def rollouts(rewards: list[float], group: int) -> dict:
    n = len(rewards)
    return {"prompt_token_ids": [[1, 2]] * n, "response_ids": [[3, 4, 5]] * n, "rewards": list(rewards),
            "loss_masks": [[1, 1, 1]] * n, "uids": [i // group for i in range(n)],
            "trajectory_ids": [(i // group, i % group) for i in range(n)], "is_last_step": [True] * n}


def test_failed_samples_leave_their_group_and_lonely_groups_become_placeholders():
    out = rollouts([1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.4, 0.1, 0.7], group=3)
    failed = [False, True, False,  True, True, False,  True, True, True]  # noqa: E241 - groups of 3
    kept, metrics = drop_failed_samples(out, failed)
    validate_generator_output(kept, step_wise=True)
    assert metrics == {FAILED_SAMPLES: 6.0, DROPPED_GROUPS: 2.0}
    # group 0 keeps its two scored samples; groups 1 and 2 keep one placeholder row each, masked, reward 0
    assert kept["trajectory_ids"] == [(0, 0), (0, 2), (1, 0), (2, 0)]
    assert kept["rewards"] == [1.0, 0.5, 0.0, 0.0] and kept["loss_masks"][2:] == [[0, 0, 0]] * 2
    assert out["rewards"][3] == 0.2 and out["loss_masks"][3] == [1, 1, 1]  # the input is not modified
    # the batch still holds 3 prompts (mini-batches count prompts); the baseline is over the scored samples
    assert len(compute_prompt_mini_batch_boundaries(kept["uids"], 3)) == 1
    scores = torch.tensor(kept["rewards"])[:, None]
    adv, _ = grpo_advantages(scores, torch.ones_like(scores), kept["uids"], AlgorithmSettings())
    reference, _ = grpo_advantages(torch.tensor([[1.0], [0.5]]), torch.ones(2, 1), [0, 0], AlgorithmSettings())
    assert torch.equal(adv[:2], reference) and torch.equal(adv[2:], torch.zeros(2, 1))


def test_step_wise_trajectories_fail_whole_and_nothing_failed_is_a_no_op():
    out = rollouts([0.0, 1.0, 0.0, 0.5, 0.0, 0.2], group=6)
    out["trajectory_ids"] = [(0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 2)]  # 3 episodes of 2 turns
    out["is_last_step"] = [False, True] * 3
    kept, metrics = drop_failed_samples(out, [True, False, False, False, False, False])
    assert kept["trajectory_ids"] == [(0, 1), (0, 1), (0, 2), (0, 2)] and metrics[FAILED_SAMPLES] == 1.0
    assert drop_failed_samples(out, [False] * 6) == (out, {FAILED_SAMPLES: 0.0, DROPPED_GROUPS: 0.0})
    with pytest.raises(AllSamplesFailed):
        drop_failed_samples(out, [True, False, True, False, True, False])


def test_failure_line_names_the_row_and_the_exception():
    line = failure(3, 17, ValueError("bad\n  answer")).line("reward.function")
    assert line == "reward.function failed on row 17: ValueError: bad answer"


def test_a_reward_that_raises_on_some_rows_fails_only_those_samples(word_tokenizer, tmp_path):
    (tmp_path / "picky.py").write_text(
        "def reward(prompt, response, answer):\n"
        "    if prompt.startswith('3 '):\n"
        "        raise ValueError('no threes')\n"
        "    return float(response.split()[:1] == [answer])\n")
    env = SingleTurnEnvironment(DataConfig(train_files=str(TRAIN), shuffle=False),
                                RewardConfig(function=f"{tmp_path / 'picky.py'}:reward"), word_tokenizer, seed=0,
                                max_prompt_tokens=16)
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=env.stop_token_ids)
    out = env.rollout(BuiltinEngine(oracle_and_noise(word_tokenizer)), spec, num_prompts=4, n_samples_per_prompt=3,
                      seed=1, step_wise=False)
    assert [p.text for p in env.train.kept[:4]][3].startswith("3 ")  # file order: row 3 is the bad one
    assert out.metrics[FAILED_SAMPLES] == 3.0 and out.metrics[DROPPED_GROUPS] == 1.0
    assert out.failures[0].row == 3 and out.failures[0].error == "ValueError: no threes"
    assert out.output["uids"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # prompt 3: one placeholder row, nothing trained
    assert out.output["loss_masks"][-1] == [0] * len(out.output["response_ids"][-1]) and out.output["rewards"][-1] == 0
    assert [s.row for s in out.samples] == [0, 1, 2, 3] and out.samples[3].reward is None
    validate_generator_output(out.output, step_wise=False)


def test_a_step_where_every_sample_failed_names_the_first_failure(word_tokenizer, tmp_path):
    (tmp_path / "broken.py").write_text(
        "def reward(prompt, response, answer):\n"
        "    if response == '':\n"
        "        return 0.0\n"  # passes the start-up check (called with response='')
        "    return {'reward': 1.0, 'oops': 'text'}\n")
    env = SingleTurnEnvironment(DataConfig(train_files=str(TRAIN)),
                                RewardConfig(function=f"{tmp_path / 'broken.py'}:reward"), word_tokenizer, seed=0,
                                max_prompt_tokens=16)
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=env.stop_token_ids)
    with pytest.raises(AllSamplesFailed, match=r"all 4 samples .* first: reward.function failed on row \d+: "
                                               r"ConfigError: .*oops='text'"):
        env.rollout(BuiltinEngine(oracle_and_noise(word_tokenizer)), spec, num_prompts=2, n_samples_per_prompt=2,
                    seed=1, step_wise=False)


def test_episodes_of_both_multi_turn_environments_assemble_with_a_placeholder_carrying_zero_routing():
    """The one assembly of the step API and the agent (``assemble_episodes``): an episode that played no turn (a
    reset that raised, an agent that made no call) stands as one masked row, with zero ``routed_experts`` of the
    played rows' (L, k) where they carry them (MoE routing replay R3 needs them on every row)."""
    import numpy as np

    def turn(uid, sample, reward, last):
        return {"prompt_token_ids": [1, 2], "response_ids": [3, 4], "rewards": reward, "loss_masks": [1, 1],
                "uids": uid, "rollout_logprobs": [-0.5, -0.5], "trajectory_ids": (uid, sample), "is_last_step": last,
                "stop_reasons": "stop", "routed_experts": np.ones((4, 3, 2), dtype=np.int64)}

    episodes = [EpisodeRows([turn(0, 0, 0.0, False), turn(0, 0, 1.0, True)], 0, (0, 0), False),
                EpisodeRows([turn(0, 1, 0.0, True)], 0, (0, 1), False),
                EpisodeRows([], 1, (1, 0), True), EpisodeRows([], 1, (1, 1), True)]
    output, metrics = assemble_episodes(episodes, pad_token_id=7, eos_token_id=2, what="job.agent='a.py:f'",
                                        first_failure="f failed on row 1")
    validate_generator_output(output, step_wise=True)
    assert metrics == {FAILED_SAMPLES: 2.0, DROPPED_GROUPS: 1.0} and output["uids"] == [0, 0, 0, 1]
    placeholder = output["routed_experts"][-1]
    assert placeholder.shape == (2, 3, 2) and not placeholder.any() and output["loss_masks"][-1] == [0]
    plain = [EpisodeRows([{k: v for k, v in turn(0, 0, 1.0, True).items() if k != "routed_experts"}], 0, (0, 0), False),
             EpisodeRows([], 0, (0, 1), True)]
    assert "routed_experts" not in assemble_episodes(plain, pad_token_id=7, eos_token_id=2, what="x",
                                                     first_failure="y")[0]
    with pytest.raises(AllSamplesFailed, match=r"all 2 samples of the step failed: every episode of "
                                               r"job.agent='a.py:f' failed; first: f failed on row 1"):
        assemble_episodes(episodes[2:], pad_token_id=7, eos_token_id=2, what="job.agent='a.py:f'",
                          first_failure="f failed on row 1")
