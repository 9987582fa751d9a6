"""model/kv_cache.py: the built-in engine's incremental decoding equals the full forward it replaces.

Reference: the same single-process ``MegatronPolicy`` (GQA, q/k norms, RoPE) through the no-cache path,
``policy.next_token_logprobs`` over each whole context. The claim is exactness up to fp32 rounding: the cached
keys/values are those the full forward computes for the same tokens at the same positions, and each new query
attends to exactly the keys the causal full forward gives it; only the shapes of the matmuls and softmaxes
differ. Measured difference ~5e-7; tolerance 2e-5 (the one of the sampler's table against ``forward`` in
tests/inference/test_builtin_multirank.py). The same seed then draws the same tokens (multinomial on tables that agree
to 1e-6 flips a draw only at a CDF boundary closer than that: not for these seeds). TP/PP/DP (and the
sequence-parallel padding) are checked in tests/inference/test_builtin_multirank.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.data.batch import left_pad
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.inference.builtin_engine import BuiltinEngine, PolicyDecoder
from megatron_rl.inference.engine import SamplingSpec

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=24", "model.qk_layernorm=true",
         "model.attention_backend=local", "parallel.device=cpu"]
PROMPTS = [[3, 5, 7], [3, 5, 7], [9], [4, 11, 2, 8, 6, 1], [12, 13]]  # different lengths, a duplicate
TOL = 2e-5


@pytest.fixture(scope="module")
def policy():
    from megatron_rl.model.policy import MegatronPolicy

    config = load_config(None, [*MODEL, "batch.micro_batch_size=2"])
    groups = initialize_distributed(config.parallel, seed=5)
    yield MegatronPolicy(config, groups, role="reference", pad_token_id=0)
    destroy_distributed()


def test_each_decoding_step_matches_the_full_forward(policy) -> None:
    decoder = PolicyDecoder(policy, pad_token_id=0)
    contexts = [list(p) for p in PROMPTS]
    got = decoder.prefill(PROMPTS)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        full = policy.next_token_logprobs(*left_pad(contexts, 0))
        assert got.shape == full.shape == (len(PROMPTS), 24)
        assert torch.allclose(got, full, atol=TOL), (step, (got - full).abs().max())
        tokens = torch.randint(1, 24, (len(PROMPTS),), generator=gen).tolist()
        for context, token in zip(contexts, tokens):
            context.append(token)
        got = decoder.extend(tokens)
    assert decoder.cache.lengths == {i: len(c) for i, c in enumerate(contexts)}


def test_generate_same_tokens_and_logprobs_as_without_cache(policy) -> None:
    prompts = [p for p in PROMPTS for _ in range(2)]
    cached = BuiltinEngine.from_policy(policy, 0)
    plain = BuiltinEngine.from_policy(policy, 0, kv_cache=False)
    assert cached.decoder is not None and plain.decoder is None
    reasons = set()
    for seed, temperature, top_p in ((1, 1.0, 1.0), (2, 0.7, 0.8)):
        spec = SamplingSpec(max_tokens=8, temperature=temperature, stop_token_ids=(2, 5), top_p=top_p)
        a, b = cached.generate(prompts, spec, seed=seed), plain.generate(prompts, spec, seed=seed)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
        reasons |= {c.finish_reason for c in a}
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=TOL)
    assert reasons == {"stop", "length"}  # rows stopped early kept their places in the cache


def test_decoding_step_is_one_micro_batch(policy, monkeypatch) -> None:
    """config.batch says 2 rows per micro-batch; a decoding step (one token per row) runs as one."""
    from megatron_rl.model import policy as policy_module

    counts = []
    real = policy_module.schedule.run_schedule

    def counting(model, call, *args, **kwargs):
        counts.append(len(call.microbatches))
        return real(model, call, *args, **kwargs)

    monkeypatch.setattr(policy_module.schedule, "run_schedule", counting)
    decoder = PolicyDecoder(policy, pad_token_id=0)
    decoder.prefill(PROMPTS)
    decoder.extend([1] * len(PROMPTS))
    assert counts == [3, 1]


def test_a_forward_lays_out_its_tokens_once_for_all_layers(policy, monkeypatch) -> None:
    """``KVCache.attend``'s layout (where the new tokens go, what they attend to: one ``cu_seqlens_q.tolist()``, a
    host sync on a GPU) is computed by a forward's first layer and reused by the others (2 layers here): one per
    micro-batch forward, not one per layer."""
    from megatron_rl.model.kv_cache import KVCache

    calls = []
    real = KVCache._layout
    monkeypatch.setattr(KVCache, "_layout", lambda self, params, device: calls.append(1) or real(self, params, device))
    decoder = PolicyDecoder(policy, pad_token_id=0)
    decoder.prefill(PROMPTS)  # 3 micro-batches
    decoder.extend([1] * len(PROMPTS))  # 1
    assert len(calls) == 4


def test_decoding_steps_reuse_the_first_steps_plan(policy, monkeypatch) -> None:
    """A decoding step's rows and lengths never change: the first step's plan is reused by the others with
    their tokens (``model/plan.py: with_tokens``; the exactness tests above would fail on a wrong token)."""
    calls = []
    real = type(policy).plan_call
    monkeypatch.setattr(type(policy), "plan_call", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    decoder = PolicyDecoder(policy, pad_token_id=0)
    decoder.prefill(PROMPTS)
    for token in (1, 2, 3):
        decoder.extend([token] * len(PROMPTS))
    assert len(calls) == 2  # the prefill's and the first step's
