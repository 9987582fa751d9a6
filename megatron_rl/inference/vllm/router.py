"""Which engine serves which request: a pure function of the batch, so a run is reproducible.

Place in the data flow: ``fleet.py`` routes every ``generate`` call's prompts with ``route`` before sending them,
and routes again (over the engines still serving) the requests of an engine that failed.

Rules:
- **A group stays on one engine.** Requests with the same prompt (the samples of one GRPO group, or the turns
  of a session with the same ``key``) go to the same engine, where they share the prefix cache.
- **Least-loaded by the batch's own work.** Groups are taken in order of first appearance; each goes to the
  serving engine with the least work assigned so far (work = prompt tokens + ``max_tokens`` per request), ties
  to the lowest engine index. The assignment depends only on the prompts, the engines serving and
  ``max_tokens``, never on timing, so two identical runs send identical requests to identical engines.
- **One request per group** (``requests``): the samples of a group on one engine whose seeds follow one another
  (the fleet's per-sample seeds do: ``engine.py``) go as one request for ``n`` samples, at most
  ``MAX_SAMPLES_PER_REQUEST``; vLLM seeds its ``k``-th sample with ``seed + k``, so each sample is the one its
  own request would draw. Greedy calls (temperature below vLLM's 1e-5: it refuses ``n > 1``) send one request
  per sample.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MAX_SAMPLES_PER_REQUEST = 64
"""The most samples one request asks for (vLLM's scheduler runs at most ``--max-num-seqs``, 256 on the engines the
job starts, at once; a bigger group is split into several requests)."""


def group_keys(prompts: Sequence[Sequence[int]]) -> list[Hashable]:
    """One key per prompt: identical prompts share a key (a GRPO group)."""
    return [tuple(int(t) for t in p) for p in prompts]


def route(prompts: Sequence[Sequence[int]], engines: Sequence[int], *, max_tokens: int,
          keys: Sequence[Hashable] | None = None) -> list[int]:
    """The engine (one of ``engines``, the indices serving) for each prompt.

    ``keys``: the routing key of each prompt (default: the prompt itself, ``group_keys``)."""
    if not engines:
        raise ValueError("route: no engine is serving")
    keys = group_keys(prompts) if keys is None else list(keys)
    if len(keys) != len(prompts):
        raise ValueError(f"route: {len(keys)} keys for {len(prompts)} prompts")
    work = dict.fromkeys(engines, 0)
    placed: dict[Hashable, int] = {}
    group_work: dict[Hashable, int] = {}
    for key, prompt in zip(keys, prompts):
        group_work[key] = group_work.get(key, 0) + len(prompt) + max_tokens
    for key in group_work:  # dicts keep insertion order: groups in order of first appearance
        engine = min(engines, key=lambda e: (work[e], e))
        placed[key] = engine
        work[engine] += group_work[key]
    return [placed[key] for key in keys]


def requests(todo: Sequence[int], engines: Sequence[int], prompts: Sequence[Sequence[int]], seeds: Sequence[int], *,
             greedy: bool = False, max_n: int = MAX_SAMPLES_PER_REQUEST) -> list[tuple[list[int], int]]:
    """The requests that serve samples ``todo`` (indices into ``prompts`` and ``seeds``; ``engines[k]`` serves
    ``todo[k]``): ``(samples, engine)`` per request, in order. A request's samples share the prompt and the engine
    and have seeds ``s, s + 1, ...`` (it asks for ``n = len(samples)`` with seed ``s``); ``greedy``: one each."""
    if len(engines) != len(todo):
        raise ValueError(f"requests: {len(engines)} engines for {len(todo)} samples")
    out: list[tuple[list[int], int]] = []
    for i, engine in zip(todo, engines):
        if out and not greedy:
            samples, last_engine = out[-1]
            last = samples[-1]
            if (last_engine == engine and len(samples) < max_n and seeds[i] == seeds[last] + 1
                    and list(prompts[i]) == list(prompts[last])):
                samples.append(i)
                continue
        out.append(([i], engine))
    return out
