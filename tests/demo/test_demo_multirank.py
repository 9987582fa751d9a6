"""The demo's Megatron integration on TP2 (one 2-rank gloo spawn, shared by the tests of this module).

- the fast sampling path (one forward, vocab-parallel log-softmax of the last position) equals the candidate
  path through the policy's public ``forward`` (the reference), and both ranks get the same table;
- both ranks sample the same multi-turn rollouts;
- one RL step on those step-wise rollouts with prefix merging off and on (two policies, same initial weights,
  SGD): the same number of optimizer steps, finite and equal losses, and the same updated weights (a causal
  model sees every turn's tokens with the same context either way, and token_mean weighs every token alike).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

CONTEXTS = [[1, 7, 3], [1, 7, 3], [1, 9, 3, 10, 2, 4, 12, 3], [1, 15, 3, 6], [2]]


def _tp2_checks(rank: int, world_size: int) -> dict:
    from megatron_rl.config import load_config
    from megatron_rl.demo.environment import NextDigitGame
    from megatron_rl.demo.policy_sampling import candidate_next_token_logprobs, last_token_next_token_logprobs
    from megatron_rl.demo.rollout import episodes_to_generator_output, play_episodes
    from megatron_rl.demo.sampler import SamplingParams, sampling_generator
    from megatron_rl.demo.tokenizer import DigitTokenizer
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    overrides = ["parallel.tensor_model_parallel_size=2", "batch.train_batch_size=4", "batch.policy_mini_batch_size=2",
                 "batch.n_samples_per_prompt=3", "batch.update_epochs_per_batch=1",
                 "optimizer.optimizer=sgd", "optimizer.lr=0.5",
                 "optimizer.lr_warmup_steps=0"]
    config = load_config("configs/demo_cpu.yaml", overrides, world_size=world_size)
    groups = initialize_distributed(config.parallel, config.seed)
    tok = DigitTokenizer()
    policies = {merge: MegatronPolicy(config, groups, pad_token_id=tok.pad_token_id) for merge in (False, True)}
    policies[True].load_full_state_dict(policies[False].full_state_dict())
    fast = last_token_next_token_logprobs(policies[False], tok.vocab_size)
    result = {
        "fast": fast(CONTEXTS),
        "candidate": candidate_next_token_logprobs(policies[False], tok.vocab_size, tok.pad_token_id)(CONTEXTS),
    }
    game = NextDigitGame(tok, num_turns=3)
    params = SamplingParams(max_new_tokens=3, stop_token_id=tok.eos_token_id)
    played = play_episodes(game, fast, params, num_prompts=4, n_samples_per_prompt=3, rng=random.Random(0),
                           generator=sampling_generator(config.seed, 1))
    rollouts = episodes_to_generator_output(played, step_wise=True)
    result["responses"] = [p.episode.responses for p in played]
    for merge, policy in policies.items():
        config.stepwise.merge_stepwise_output = merge
        trainer = Trainer(config, policy, pad_token_id=tok.pad_token_id, dp_size=groups.dp_size)
        result[f"metrics_{merge}"] = trainer.train_step(rollouts)
        result[f"steps_{merge}"] = trainer.optimizer_steps
        result[f"weights_{merge}"] = {k: v.detach().clone() for k, v in policy.full_state_dict().items()}
    return result


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(2, _tp2_checks, timeout=240)


def test_fast_sampling_path_matches_candidate_path(tp2) -> None:
    for rank_result in tp2:
        assert torch.allclose(rank_result["fast"], rank_result["candidate"], atol=2e-5), \
            (rank_result["fast"] - rank_result["candidate"]).abs().max()
        assert torch.allclose(rank_result["fast"].exp().sum(-1), torch.ones(len(CONTEXTS)), atol=1e-5)
    assert torch.equal(tp2[0]["fast"], tp2[1]["fast"])


def test_ranks_sample_the_same_rollouts(tp2) -> None:
    assert tp2[0]["responses"] == tp2[1]["responses"]
    assert any(len(turn) > 1 for episode in tp2[0]["responses"] for turn in episode)


def test_merging_on_and_off_same_steps_same_update(tp2) -> None:
    result = tp2[0]
    assert result["steps_False"] == result["steps_True"] == 2  # 4 games / 2 per mini-batch, 1 epoch
    off, on = result["metrics_False"], result["metrics_True"]
    assert on["stepwise/num_seq_before_merge"] == 36 and on["stepwise/num_seq_after_merge"] == 12
    assert off["batch/num_sequences"] == 36 and on["batch/num_sequences"] == 12
    for key in ("policy/loss", "reward/mean", "batch/loss_tokens", "optim/grad_norm"):
        assert math.isfinite(off[key]) and off[key] == pytest.approx(on[key], rel=1e-4, abs=1e-6), key
    for name, weight in result["weights_False"].items():
        assert torch.allclose(weight, result["weights_True"][name], atol=1e-5), name
    for name, weight in result["weights_False"].items():  # both TP ranks see the same gathered full weights
        assert torch.equal(weight, tp2[1]["weights_False"][name]), name
