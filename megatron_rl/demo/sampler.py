"""Temperature sampling of responses, recording the rollout log-probs.

Place in the data flow: ``demo/rollout.py`` calls ``sample_responses`` once per turn of the game; its responses
go to the environment, its log-probs become ``GeneratorOutput`` rollout log-probs (checked by the trainer against
the policy's own log-probs: the rollout/old mismatch metrics).

The model is reached through one function, ``next_token_logprobs(contexts) -> [n, V]``: log-softmax (temperature 1)
of the next token after each context. ``demo/policy_sampling.py`` implements it with the Megatron policy (every
rank takes part, results identical on every rank); tests implement it with plain torch. The sampler does repeated
full forward passes over the growing contexts (no KV cache): the demo model is tiny.

All ranks must sample the same tokens: they call this with the same contexts, identical log-probs and a
``torch.Generator`` seeded identically (``sampling_generator``), so the draws agree without communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

NextTokenLogprobs = Callable[[Sequence[Sequence[int]]], torch.Tensor]
"""``contexts (n token lists) -> [n, V]`` float log-probs of the next token (temperature 1)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    """Response length cap; a response that reaches it without the stop token ends with stop reason 'length'."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    stop_token_id: int
    """Token that ends a response (kept in the response)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")


@dataclass
class Samples:
    responses: list[list[int]]
    """Generated tokens per prompt (the stop token included when it was sampled)."""
    logprobs: list[list[float]]
    """Log-prob of each generated token under the sampling distribution (temperature applied)."""
    stop_reasons: list[str]
    """'stop' (stop token sampled) or 'length' (max_new_tokens reached)."""


def sampling_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for one train step's rollouts: same (seed, step) on every rank gives the same draws."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed * 1_000_003 + step)
    return gen


def sample_next_tokens(
    logprobs: torch.Tensor, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logprobs [n, V]``; returns ``(tokens [n] int64, token_logprobs [n] fp32)``.

    The recorded log-prob is that of the distribution actually sampled from (softmax of logits / temperature);
    greedy (temperature 0) records the temperature-1 log-prob of the argmax.
    """
    logprobs = logprobs.detach().float().cpu()
    if temperature == 0:
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    scaled = torch.log_softmax(logprobs / temperature, dim=-1)  # [n, V]
    tokens = torch.multinomial(scaled.exp(), 1, generator=generator)[:, 0]  # [n]
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0]


def sample_responses(
    next_token_logprobs: NextTokenLogprobs,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator,
) -> Samples:
    """Sample one response per prompt: repeated forward passes over the rows that have not stopped yet."""
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(params.max_new_tokens):
        if not active:
            break
        contexts = [list(prompts[i]) + responses[i] for i in active]
        next_lp = next_token_logprobs(contexts)  # [n_active, V]
        assert next_lp.shape[0] == len(active), (next_lp.shape, len(active))
        tokens, token_lp = sample_next_tokens(next_lp, params.temperature, generator)
        for i, token, lp in zip(active, tokens.tolist(), token_lp.tolist()):
            responses[i].append(token)
            logprobs[i].append(lp)
        active = [i for i in active if responses[i][-1] != params.stop_token_id]
    stop_reasons = ["stop" if r and r[-1] == params.stop_token_id else "length" for r in responses]
    return Samples(responses=responses, logprobs=logprobs, stop_reasons=stop_reasons)


def uniform_next_token_logprobs(vocab_size: int) -> NextTokenLogprobs:
    """A policy that picks every token with probability 1/vocab_size (the demo's random baseline)."""

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.full((len(contexts), vocab_size), -float(torch.log(torch.tensor(float(vocab_size)))))

    return next_token_logprobs
