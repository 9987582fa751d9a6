"""BuiltinEngine follows the RolloutEngine protocol: one completion per prompt, reproducible per seed, a repeated
seed continues the stream (multi-turn rollouts), nucleus sampling, and a free weight update."""

from __future__ import annotations

import torch

from megatron_rl.inference.builtin_engine import BuiltinEngine, sample_next_tokens, sample_responses
from megatron_rl.inference.engine import RolloutEngine, SamplingSpec

V = 12


def bigram(seed: int = 0):
    table = torch.log_softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(seed)), -1)
    return lambda contexts: table[[c[-1] for c in contexts]]


def test_generate_is_reproducible_and_a_repeated_seed_continues_the_stream():
    spec = SamplingSpec(max_tokens=4, stop_token_ids=(0,))
    prompts = [[1, 2], [3], [4, 5, 6]]
    engine: RolloutEngine = BuiltinEngine(bigram())
    first = engine.generate(prompts, spec, seed=9)
    second = engine.generate(prompts, spec, seed=9)  # same seed again: the stream goes on
    again = BuiltinEngine(bigram())
    assert again.generate(prompts, spec, seed=9) == first and again.generate(prompts, spec, seed=9) == second
    generator = torch.Generator().manual_seed(9)
    one_stream = [sample_responses(bigram(), prompts, spec, generator) for _ in range(2)]
    assert [c.token_ids for c in first] == one_stream[0].responses
    assert [c.token_ids for c in second] == one_stream[1].responses
    assert all(c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids) for c in first)
    assert engine.update_weights(object()) == 0.0
    engine.close()
    engine.close()


def test_top_p_keeps_the_nucleus_and_records_its_log_probs():
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    tokens = [int(sample_next_tokens(logprobs, 1.0, gen, top_p=0.7)[0]) for _ in range(200)]
    assert set(tokens) == {0, 1}  # 0.5 < 0.7: the second token is needed, the third is not
    token, lp = sample_next_tokens(logprobs, 1.0, torch.Generator().manual_seed(1), top_p=0.7)
    assert torch.allclose(lp.exp(), torch.tensor([0.5, 0.3])[token] / 0.8)
    tiny = sample_next_tokens(logprobs.repeat(50, 1), 1.0, gen, top_p=1e-6)
    assert (tiny[0] == 0).all() and torch.allclose(tiny[1], torch.zeros(50))
