"""The built-in rollout engine: temperature / nucleus sampling with the policy's own packed forward.

Place in the data flow: the rollout stage of the main job (``megatron_rl/environments/*``) calls
``BuiltinEngine.generate`` through the ``RolloutEngine`` protocol (``inference/engine.py``); the responses go to
the environment, the recorded log-probs become ``GeneratorOutput`` rollout log-probs (checked by the trainer
against the policy's own: the rollout/old mismatch metrics).

The model is reached through one of two interfaces, both log-softmax (temperature 1) of the next token:

    next_token_logprobs(contexts) -> [n, V]      a full forward over each whole context (no cache): tests' plain
                                                 torch stand-ins, and the policy under context parallelism
    Decoder: prefill(prompts) -> [n, V],         incremental decoding with a KV cache (``PolicyDecoder``: the
             extend(tokens) -> [n, V]            policy with ``model/kv_cache.py``), what ``from_policy`` uses

Both are collective with the Megatron policy (every rank takes part, results identical on every rank). With the
cache a call runs each row's new token only (one micro-batch per decoding step, whatever ``config.batch``'s
rule): prefill once, then one token per row per step; a stopped row keeps its place (its token is ignored) so
the rows never move between DP ranks. A vision-language policy's prompts are prefilled with their images (the
vision tower once), its decoded tokens take 3-D positions from the cache (docs/VISION.md section 8). Exact against the full forward up to float rounding
(``tests/inference/test_kv_cache.py``): the same seed gives the same tokens. Meant for small models and tests; a
real checkpoint on a GPU samples with ``rollout.engine: vllm``.

Collective and reproducible: every rank calls ``generate`` with the same prompts and seed, computes identical
log-probs and draws with an identically seeded CPU ``torch.Generator``, so the draws agree without communication.
A call with a new ``seed`` starts a fresh stream; a call that repeats the previous call's seed continues the same
stream, so a multi-turn episode that passes its step's seed on every turn draws one sequence (what makes a
resumed run replay the uninterrupted one). The engine samples from the live policy: ``update_weights`` is free.

MoE routing replay R3 (``model.moe_router_replay: r3``): ``from_policy`` also records the routing, one extra
forward over the finished sequences (prompt + response, recording each MoE layer's top-k:
``MegatronPolicy.next_token_logprobs(record_routing=True)``); each ``Completion.extra["routed_experts"]`` is an
integer array ``[len(prompt) + len(response), L, k]``, for ``GeneratorOutput['routed_experts']``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from megatron_rl.data.batch import left_pad as left_padded
from megatron_rl.inference.engine import Completion, EngineCapabilities, SamplingSpec

NextTokenLogprobs = Callable[[Sequence[Sequence[int]]], torch.Tensor]
"""``contexts (n token lists) -> [n, V]`` float log-probs of the next token (temperature 1)."""


class Decoder(Protocol):
    """Incremental next-token log-probs over a fixed set of rows (one ``generate`` call)."""

    def prefill(self, prompts: Sequence[Sequence[int]], images: Sequence[Any] | None = None) -> torch.Tensor:
        """Start the rows with their prompts (and their images: a vision-language policy); ``[n, V]`` log-probs
        of each row's first new token."""

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to every row; ``[n, V]`` log-probs of each row's next token."""


ImageLogprobs = Callable[[Sequence[Sequence[int]], Sequence[Any]], torch.Tensor]
"""``(contexts, images) -> [n, V]``: ``NextTokenLogprobs`` of contexts with images (per row a list of
``(pixel_values [n, F], (t, h, w))``, ``GeneratorOutput['images']``)."""

RoutedExperts = Callable[[Sequence[Sequence[int]]], list[np.ndarray]]
"""``sequences (n token lists) -> n arrays [len, L, k]``: each token's top-k experts per MoE layer (R3)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampler's settings with a single stop token (``SamplingSpec`` is the engine-facing form)."""

    max_new_tokens: int
    """Response length cap; a response that reaches it without the stop token ends with stop reason 'length'."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    stop_token_id: int
    """Token that ends a response (kept in the response)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")

    def to_spec(self) -> SamplingSpec:
        return SamplingSpec(max_tokens=self.max_new_tokens, temperature=self.temperature,
                            stop_token_ids=(self.stop_token_id,), top_p=self.top_p)


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
    gen.manual_seed(rollout_seed(seed, step))
    return gen


def rollout_seed(seed: int, step: int) -> int:
    """The engine seed of train step ``step`` of a run with ``seed`` (step -1: the random baseline)."""
    return seed * 1_000_003 + step


def sample_next_tokens(
    logprobs: torch.Tensor, temperature: float, generator: torch.Generator, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logprobs [n, V]``; returns ``(tokens [n] int64, token_logprobs [n] fp32)``.

    The recorded log-prob is that of the distribution actually sampled from (softmax of logits / temperature,
    renormalized over the nucleus when ``top_p < 1``); greedy (temperature 0) records the temperature-1 log-prob
    of the argmax.
    """
    logprobs = logprobs.detach().float().cpu()
    if temperature == 0:
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    scaled = torch.log_softmax(logprobs / temperature, dim=-1)  # [n, V]
    if top_p < 1.0:
        scaled = _nucleus(scaled, top_p)
    tokens = torch.multinomial(scaled.exp(), 1, generator=generator)[:, 0]  # [n]
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0]


def _nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logprobs [n, V]`` restricted to the smallest top set of mass >= top_p, renormalized (others -inf)."""
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()  # [n, V] mass of the tokens ranked above
    drop_sorted = mass_before >= top_p  # the first token is always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, -float("inf")), dim=-1)


def sample_responses(
    next_token_logprobs: NextTokenLogprobs | Decoder,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | SamplingSpec,
    generator: torch.Generator,
    images: Sequence[Any] | None = None,
) -> Samples:
    """Sample one response per prompt: a forward per step over the rows that have not stopped yet (a
    ``Decoder``: its new token of every row; the draws are the same: only the active rows are sampled).
    ``images``: per prompt (``ImageLogprobs``: called with the active rows' images, full forwards; a ``Decoder``:
    its prefill's)."""
    spec = params.to_spec() if isinstance(params, SamplingParams) else params
    stop = set(spec.stop_token_ids)
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    decoder = next_token_logprobs if hasattr(next_token_logprobs, "prefill") else None
    for step in range(spec.max_tokens):
        if not active:
            break
        if decoder is None:
            contexts = [list(prompts[i]) + responses[i] for i in active]
            next_lp = (next_token_logprobs(contexts) if images is None  # [n_active, V]
                       else next_token_logprobs(contexts, [images[i] for i in active]))
        elif step == 0:
            next_lp = (decoder.prefill(prompts) if images is None else decoder.prefill(prompts, images))[active]
        else:  # every row's last token (a stopped row's is ignored), so the rows keep their places
            next_lp = decoder.extend([r[-1] if r else 0 for r in responses])[active]
        assert next_lp.shape[0] == len(active), (next_lp.shape, len(active))
        tokens, token_lp = sample_next_tokens(next_lp, spec.temperature, generator, spec.top_p)
        for i, token, lp in zip(active, tokens.tolist(), token_lp.tolist()):
            responses[i].append(token)
            logprobs[i].append(lp)
        active = [i for i in active if responses[i][-1] not in stop]
    stop_reasons = ["stop" if r and r[-1] in stop else "length" for r in responses]
    return Samples(responses=responses, logprobs=logprobs, stop_reasons=stop_reasons)


def uniform_next_token_logprobs(vocab_size: int) -> NextTokenLogprobs:
    """A policy that picks every token with probability 1/vocab_size (the random baseline)."""

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.full((len(contexts), vocab_size), -float(torch.log(torch.tensor(float(vocab_size)))))

    return next_token_logprobs


def policy_next_token_logprobs(policy, pad_token_id: int) -> NextTokenLogprobs:
    """``contexts -> [n, V]`` (V = the policy's ``model.vocab_size``) through ``policy.next_token_logprobs``.

    Identical contexts (a GRPO group's samples share their prompt) are computed once: the distinct contexts are
    left-padded into one ``[u, S]`` block and the policy returns the full-vocab log-softmax after each one's last
    token, through its pipeline schedule (any TP/PP/DP layout), identical on every rank. Collective.
    """

    def next_token_logprobs(contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        unique, index = _dedupe(contexts)
        logprobs = policy.next_token_logprobs(*left_padded(unique, pad_token_id))  # [u, V]
        return logprobs.float().cpu()[index]  # [n, V]

    return next_token_logprobs


class PolicyDecoder:
    """``Decoder`` through ``policy.next_token_logprobs`` with a ``KVCache`` (model/kv_cache.py); collective.

    The prefill runs under ``config.batch``'s micro-batch rule (its packs hold whole prompts); each decoding step
    holds one token per row and runs as one micro-batch per DP rank (a token budget of all the rows).
    """

    def __init__(self, policy, pad_token_id: int) -> None:
        self.policy, self.pad_token_id = policy, pad_token_id
        self.cache = None
        self.num_rows = 0
        self.step_plan = None
        """The plan of a decoding step (``MegatronPolicy.plan_next_tokens``), made at the first and reused by
        the others with their tokens (``model/plan.py: with_tokens``): the rows and their lengths never change."""

    def prefill(self, prompts: Sequence[Sequence[int]], images: Sequence[Any] | None = None) -> torch.Tensor:
        """The prompts through the whole model (with ``images``: each row's, the vision tower run once here;
        the decoded tokens then take their 3-D positions from the cache's ``rope_deltas``)."""
        from megatron_rl.data.mrope import batch_images
        from megatron_rl.model.kv_cache import KVCache  # the policy's module; tests use stand-ins

        self.cache, self.num_rows, self.step_plan = KVCache(), len(prompts), None
        sequences, mask = left_padded(prompts, self.pad_token_id)
        pictures = None if images is None else batch_images(list(images))
        return self.policy.next_token_logprobs(sequences, mask, kv_cache=self.cache, images=pictures).float().cpu()

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        from megatron_rl.model.plan import with_tokens  # the policy's module; tests use stand-ins

        assert self.cache is not None and len(tokens) == self.num_rows, (len(tokens), self.num_rows)
        sequences = torch.tensor(list(tokens), dtype=torch.long)[:, None]  # [n, 1]
        mask = torch.ones_like(sequences)
        if self.step_plan is None:
            budget = -(-self.num_rows // self.policy.groups.dp_size) * self.policy.align  # every row of a DP shard
            self.step_plan = self.policy.plan_next_tokens(sequences, mask, max_tokens_per_micro_batch=budget)
        return self.policy.next_token_logprobs(sequences, mask, kv_cache=self.cache,
                                               call=with_tokens(self.step_plan, sequences)).float().cpu()


def policy_image_logprobs(policy, pad_token_id: int) -> ImageLogprobs:
    """``(contexts, images) -> [n, V]`` through ``policy.next_token_logprobs(images=...)`` (a
    ``VisionLanguagePolicy``): a full forward over each context with its images (the vision tower runs every
    decoding step): the engine's path without the KV cache (``from_policy(kv_cache=False)``, a hybrid model).
    Rows with the same context and the same images object (a group's samples) are computed once. Collective."""
    from megatron_rl.data.mrope import batch_images

    def next_token_logprobs(contexts: Sequence[Sequence[int]], images: Sequence[Any]) -> torch.Tensor:
        position: dict[tuple, int] = {}
        rows: list[int] = []  # the first row of each distinct (context, images)
        for row, key in enumerate((tuple(c), id(i)) for c, i in zip(contexts, images)):
            if key not in position:
                position[key] = len(rows)
                rows.append(row)
        index = torch.tensor([position[(tuple(c), id(i))] for c, i in zip(contexts, images)])
        batch = left_padded([contexts[r] for r in rows], pad_token_id)
        logprobs = policy.next_token_logprobs(*batch, images=batch_images([images[r] for r in rows]))
        return logprobs.float().cpu()[index]  # [n, V]

    return next_token_logprobs


def policy_routed_experts(policy, pad_token_id: int) -> RoutedExperts:
    """``sequences -> [len_i, L, k]`` arrays: the routing ``policy`` chooses for every token (one recording
    forward, any layout; collective)."""

    def routed_experts(sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        _, routing = policy.next_token_logprobs(*left_padded(sequences, pad_token_id), record_routing=True)
        width = routing.shape[1]
        return [routing[i, width - len(seq):].numpy() for i, seq in enumerate(sequences)]

    return routed_experts


def _sees_images(policy) -> bool:
    from megatron_rl.model.vision_policy import VisionLanguagePolicy

    return isinstance(policy, VisionLanguagePolicy)


def _dedupe(contexts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Distinct contexts (first-seen order) and, per input context, its index among them."""
    unique = list(dict.fromkeys(tuple(c) for c in contexts))
    position = {c: i for i, c in enumerate(unique)}
    return unique, torch.tensor([position[tuple(c)] for c in contexts])


class BuiltinEngine:
    """``RolloutEngine`` over a ``next_token_logprobs`` function (the live policy, or a stand-in in tests)."""

    capabilities = EngineCapabilities()
    """None of the optional parts: it samples from the live policy, on the training groups (``rollout.engine=
    builtin``, ``registry.py``)."""
    version = 0
    """It never syncs: the weights are the policy's own."""
    last_sync_bytes = 0
    run_on_main_thread = None
    agent_calls = None

    def __init__(self, next_token_logprobs: NextTokenLogprobs, routed_experts: RoutedExperts | None = None,
                 decoder: Callable[[], Decoder] | None = None, image_logprobs: ImageLogprobs | None = None) -> None:
        self.next_token_logprobs = next_token_logprobs
        """The full-forward path (no cache): used when ``decoder`` is None."""
        self.image_logprobs = image_logprobs
        """Set (a vision-language policy): ``generate(images=...)`` samples through it (full forwards) unless
        ``decoder`` is set (its prefill takes the images)."""
        self.decoder = decoder
        """Set: each ``generate`` decodes incrementally through a fresh ``decoder()`` (the KV-cache path)."""
        self.routed_experts = routed_experts
        """Set (R3): each completion's ``extra["routed_experts"]`` (module docstring)."""
        self._seed: int | None = None
        self._generator = torch.Generator(device="cpu")

    @classmethod
    def from_policy(cls, policy, pad_token_id: int, *, kv_cache: bool = True) -> BuiltinEngine:
        """The engine that samples from ``policy`` (a ``MegatronPolicy``) itself; collective. Decodes with a KV
        cache (``kv_cache=False``, context parallelism, or a hybrid Gated-DeltaNet model, whose linear-attention
        layers keep a recurrent state the cache does not hold: full forwards). Records the routing when the
        policy's ``model.moe_router_replay`` is "r3"."""
        record = getattr(policy.config.model, "moe_router_replay", "none") == "r3"
        from megatron_rl.hf.families import family_of

        decodes = family_of(policy.config.model).support.kv_cache_decoding  # not a hybrid model's recurrent state
        cached = kv_cache and policy.groups.cp_size == 1 and decodes
        return cls(policy_next_token_logprobs(policy, pad_token_id),
                   policy_routed_experts(policy, pad_token_id) if record else None,
                   decoder=(lambda: PolicyDecoder(policy, pad_token_id)) if cached else None,
                   image_logprobs=policy_image_logprobs(policy, pad_token_id) if _sees_images(policy) else None)

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int,
                 images: Sequence[Any] | None = None) -> list[Completion]:
        """One completion per prompt; a new ``seed`` restarts the stream, a repeated one continues it.
        ``images``: per prompt its images (``GeneratorOutput['images']``; a vision-language policy)."""
        if seed != self._seed:
            self._seed = seed
            self._generator.manual_seed(seed)
        if images is not None and self.image_logprobs is None:
            raise ValueError("BuiltinEngine.generate(images=...) needs a vision-language policy (a model.hf_path "
                             "of a Qwen2.5-VL checkpoint); this engine's policy sees text only")
        model = self.decoder() if self.decoder is not None else self.next_token_logprobs
        if images is not None and self.decoder is None:
            model = self.image_logprobs
        samples = sample_responses(model, prompts, spec, self._generator, images)
        completions = [Completion(token_ids=r, logprobs=lp, finish_reason=reason)
                       for r, lp, reason in zip(samples.responses, samples.logprobs, samples.stop_reasons)]
        if self.routed_experts is not None:
            routing = self.routed_experts([list(p) + r for p, r in zip(prompts, samples.responses)])
            for completion, experts in zip(completions, routing):
                completion.extra["routed_experts"] = experts
        return completions

    def update_weights(self, policy) -> float:
        """Nothing to do: the engine reads the policy's live weights. Returns 0.0 seconds."""
        return 0.0

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to release."""
