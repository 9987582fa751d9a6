"""The demo's Megatron integration on TP2, then PP2 (one 2-rank gloo spawn, shared by the tests of this module).

- ``MegatronPolicy.next_token_logprobs`` (the sampler's table) equals a reference through the policy's public
  ``forward`` on candidate rows ``context + [v]`` for every token v, on TP2 and on PP2 (same weights), and both
  ranks get the same table;
- both ranks sample the same multi-turn rollouts;
- the built-in engine's KV-cache decoding (model/kv_cache.py) draws the same tokens with the same log-probs
  (to 2e-5, fp32 rounding: tests/inference/test_kv_cache.py) as its full-forward path, on TP2, PP2, TP2 with
  sequence parallelism (each new token padded to 2) and DP2 (rows split over the ranks);
- one RL step on those step-wise rollouts with prefix merging off and on (two policies, same initial weights,
  SGD): the same number of optimizer steps, finite and equal losses, and the same updated weights (a causal
  model sees every turn's tokens with the same context either way, and token_mean weighs every token alike).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.multirank import run_ranks

pytestmark = pytest.mark.multirank

CONTEXTS = [[1, 7, 3], [1, 7, 3], [1, 9, 3, 10, 2, 4, 12, 3], [1, 15, 3, 6], [2]]


def candidate_batch(contexts, vocab_size: int, pad_token_id: int):
    """Rows ``contexts[i] + [v]`` for every i and v (row ``i * vocab_size + v``), response = ``[v]``."""
    from megatron_rl.data.batch import TrainingBatch, convert_prompts_responses_to_batch_tensors

    prompts = [list(c) for c in contexts for _ in range(vocab_size)]
    responses = [[v] for _ in contexts for v in range(vocab_size)]
    sequences, attention_mask, response_mask, rewards, loss_mask, _ = convert_prompts_responses_to_batch_tensors(
        pad_token_id, prompts, responses, [0.0] * len(prompts), [[1] for _ in responses]
    )
    tensors = {"sequences": sequences, "attention_mask": attention_mask, "response_mask": response_mask,
               "loss_mask": loss_mask, "rewards": rewards}
    rows = list(range(len(prompts)))
    return TrainingBatch(tensors, rows, rows, [True] * len(rows))


def _tables(policy, tok) -> dict:
    """The sampler's table for CONTEXTS and its reference through ``policy.forward`` ([n, V] each)."""
    from megatron_rl.data.batch import left_pad as left_padded
    from megatron_rl.inference.builtin_engine import policy_next_token_logprobs

    reference = policy.forward(candidate_batch(CONTEXTS, tok.vocab_size, tok.pad_token_id))["logprobs"]  # [n*V, 1]
    return {
        "table": policy_next_token_logprobs(policy, tok.pad_token_id)(CONTEXTS),
        "direct": policy.next_token_logprobs(*left_padded(CONTEXTS, tok.pad_token_id)),  # no dedupe
        "reference": reference[:, -1].view(len(CONTEXTS), tok.vocab_size),
    }


def _decodes(policy, tok) -> dict:
    """Completions of the cached and the full-forward engine on the same prompts and seed."""
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec

    spec = SamplingSpec(max_tokens=5, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    prompts = [c for c in CONTEXTS for _ in range(3)]
    out = {}
    for cached in (True, False):
        completions = BuiltinEngine.from_policy(policy, tok.pad_token_id, kv_cache=cached).generate(
            prompts, spec, seed=3)
        out[cached] = ([c.token_ids for c in completions], [torch.tensor(c.logprobs) for c in completions])
    return out


def _tp2_checks(rank: int, world_size: int) -> dict:
    from megatron_rl.job.config import load_job_config
    from megatron_rl.environments.next_digit.game import NextDigitGame
    from megatron.core import parallel_state

    from megatron_rl.inference.builtin_engine import policy_next_token_logprobs
    from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, play_episodes
    from megatron_rl.inference.builtin_engine import SamplingParams
    from megatron_rl.inference.builtin_engine import BuiltinEngine, rollout_seed
    from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    overrides = ["parallel.tensor_model_parallel_size=2", "batch.train_batch_size=4", "batch.policy_mini_batch_size=2",
                 "batch.n_samples_per_prompt=3", "batch.update_epochs_per_batch=1",
                 "optimizer.optimizer=sgd", "optimizer.lr=0.5",
                 "optimizer.lr_warmup_steps=0"]
    config = load_job_config("configs/demo_cpu.yaml", overrides).rl
    groups = initialize_distributed(config.parallel, config.seed)
    tok = DigitTokenizer()
    policies = {merge: MegatronPolicy(config, groups, pad_token_id=tok.pad_token_id) for merge in (False, True)}
    policies[True].load_full_state_dict(policies[False].full_state_dict())
    initial_weights = policies[False].full_state_dict()
    result = {"tp2": _tables(policies[False], tok), "decode_tp2": _decodes(policies[False], tok)}
    sample = policy_next_token_logprobs(policies[False], tok.pad_token_id)
    game = NextDigitGame(tok, num_turns=3)
    params = SamplingParams(max_new_tokens=3, stop_token_id=tok.eos_token_id)
    played = play_episodes(game, BuiltinEngine(sample), params.to_spec(), num_prompts=4, n_samples_per_prompt=3,
                           rng=random.Random(0), seed=rollout_seed(config.seed, 1))
    rollouts = episodes_to_generator_output(played, step_wise=True)
    result["responses"] = [p.episode.responses for p in played]
    for merge, policy in policies.items():
        config.stepwise.merge_stepwise_output = merge
        trainer = Trainer(config, policy)
        result[f"metrics_{merge}"] = trainer.train_step(rollouts)
        result[f"steps_{merge}"] = trainer.optimizer_steps
        result[f"weights_{merge}"] = {k: v.detach().clone() for k, v in policy.full_state_dict().items()}

    parallel_state.destroy_model_parallel()  # the same weights on PP2 (one layer per stage)
    pp2 = load_job_config("configs/demo_cpu.yaml", ["parallel.pipeline_model_parallel_size=2"]).rl
    policy = MegatronPolicy(pp2, initialize_distributed(pp2.parallel, pp2.seed), role="reference",
                            pad_token_id=tok.pad_token_id)
    policy.load_full_state_dict(initial_weights)
    result["pp2"] = _tables(policy, tok)
    result["decode_pp2"] = _decodes(policy, tok)
    for name, layout in (("tp2_sp", ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
                         ("dp2", [])):
        parallel_state.destroy_model_parallel()
        cfg = load_job_config("configs/demo_cpu.yaml", layout).rl
        policy = MegatronPolicy(cfg, initialize_distributed(cfg.parallel, cfg.seed), role="reference",
                                pad_token_id=tok.pad_token_id)
        policy.load_full_state_dict(initial_weights)
        result[f"decode_{name}"] = _decodes(policy, tok)
    return result


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(2, _tp2_checks, timeout=240)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_next_token_logprobs_match_forward_on_candidate_rows(tp2, layout) -> None:
    for rank_result in tp2:
        got = rank_result[layout]
        assert got["table"].shape == (len(CONTEXTS), 16) and got["table"].dtype == torch.float32
        assert torch.equal(got["table"], got["direct"])  # deduping changes nothing
        assert torch.allclose(got["table"], got["reference"], atol=2e-5), (got["table"] - got["reference"]).abs().max()
        assert torch.allclose(got["table"].exp().sum(-1), torch.ones(len(CONTEXTS)), atol=1e-5)
    assert torch.equal(tp2[0][layout]["table"], tp2[1][layout]["table"])
    assert torch.allclose(tp2[0]["tp2"]["table"], tp2[0]["pp2"]["table"], atol=2e-5)  # same weights


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2_sp", "dp2"])
def test_kv_cache_decoding_matches_full_forward(tp2, layout) -> None:
    for rank_result in tp2:
        cached, plain = rank_result[f"decode_{layout}"][True], rank_result[f"decode_{layout}"][False]
        assert cached[0] == plain[0]
        assert any(len(t) < 5 for t in cached[0]) and any(len(t) == 5 for t in cached[0])  # stops and lengths
        for a, b in zip(cached[1], plain[1]):
            assert torch.allclose(a, b, atol=2e-5), (a - b).abs().max()
    assert tp2[0][f"decode_{layout}"][True][0] == tp2[1][f"decode_{layout}"][True][0]


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
