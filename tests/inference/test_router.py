"""The fleet's router (``megatron_rl/inference/vllm/router.py``): a GRPO group stays on one engine, groups are balanced
by work, and the assignment is a function of the batch alone."""

from __future__ import annotations

import pytest

from megatron_rl.inference.vllm.router import requests, route


def _groups(sizes: list[int], length: int = 4) -> list[list[int]]:
    return [[g] * length for g, n in enumerate(sizes) for _ in range(n)]


def test_a_group_stays_on_one_engine_and_groups_spread():
    prompts = _groups([4, 4, 4, 4])
    engines = route(prompts, [0, 1], max_tokens=8)
    by_group = {}
    for prompt, engine in zip(prompts, engines):
        by_group.setdefault(prompt[0], set()).add(engine)
    assert all(len(e) == 1 for e in by_group.values())
    assert [engines.count(0), engines.count(1)] == [8, 8]


def test_least_loaded_by_work_not_by_count():
    # one long group, then three short ones: the short ones all go to the other engine
    prompts = [[0] * 100] * 2 + _groups([2, 2, 2], length=2)
    engines = route(prompts, [0, 1], max_tokens=1)
    assert engines[:2] == [0, 0] and set(engines[2:]) == {1}


def test_deterministic_and_only_serving_engines():
    prompts = _groups([3, 1, 2, 5, 2])
    assert route(prompts, [0, 2], max_tokens=4) == route([list(p) for p in prompts], [0, 2], max_tokens=4)
    assert set(route(prompts, [2], max_tokens=4)) == {2}
    with pytest.raises(ValueError, match="no engine"):
        route(prompts, [], max_tokens=4)


def test_session_keys_pin_different_prompts():
    prompts = [[1], [1, 2, 3], [7], [7, 8, 9]]
    engines = route(prompts, [0, 1], max_tokens=4, keys=["a", "a", "b", "b"])
    assert engines[0] == engines[1] and engines[2] == engines[3] and engines[0] != engines[2]


def test_one_request_per_group_with_consecutive_seeds():
    prompts = _groups([4, 3, 2])
    seeds = list(range(100, 109))
    assert requests(range(9), [0] * 4 + [1] * 3 + [0] * 2, prompts, seeds) == [
        ([0, 1, 2, 3], 0), ([4, 5, 6], 1), ([7, 8], 0)]
    # a seed that does not follow, a group split over engines, a size cap, greedy: separate requests
    assert requests(range(4), [0] * 4, prompts[:4], [1, 2, 4, 5]) == [([0, 1], 0), ([2, 3], 0)]
    assert requests(range(4), [0, 0, 1, 1], prompts[:4], seeds[:4]) == [([0, 1], 0), ([2, 3], 1)]
    assert requests(range(4), [0] * 4, prompts[:4], seeds[:4], max_n=3) == [([0, 1, 2], 0), ([3], 0)]
    assert requests(range(2), [0, 0], prompts[:2], seeds[:2], greedy=True) == [([0], 0), ([1], 0)]
    # the samples left of a call (a failed engine's): the ones whose seeds follow still go together
    assert requests([1, 2, 5, 6], [1] * 4, prompts, seeds) == [([1, 2], 1), ([5, 6], 1)]
