"""The fixtures of a multi-rank invariance test: one batch, a one-process reference run on it, and each layout's
run against that reference, every one computed once per module and only when a test asks for it.

    from tests.support.reference import layout_fixture, reference_fixtures

    tensors, reference = reference_fixtures(_tensors, _reference_rank, timeout=300)
    layout_results = layout_fixture(lambda name, tensors, reference: run_ranks(2, _layout_rank, name, tensors,
                                                                               reference["full_sd"]))

    def test_tp2(layout_results):
        results = layout_results("tp2")  # the first test that asks runs the layout; the others reuse it
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.support.multirank import run_ranks


def reference_fixtures(make_tensors: Callable[[], Any], reference_rank: Callable[..., Any], *, timeout: float,
                       name: str = "reference"):
    """Module-scoped fixtures ``tensors`` (``make_tensors()``) and ``name`` (what ``reference_rank(rank,
    world_size, tensors)`` returns on one spawned rank); assign both at module level."""

    @pytest.fixture(scope="module", name="tensors")
    def tensors():
        return make_tensors()

    @pytest.fixture(scope="module", name=name)
    def reference(tensors):
        return run_ranks(1, reference_rank, tensors, timeout=timeout)[0]

    return tensors, reference


def layout_fixture(run_layout: Callable[[str, Any, Any], Any], reference: str = "reference"):
    """Module-scoped fixture ``layout_results``: a function ``get(layout)`` that returns ``run_layout(layout,
    tensors, <the reference fixture>)``, run once per layout."""

    @pytest.fixture(scope="module", name="layout_results")
    def layout_results(tensors, request):
        ref = request.getfixturevalue(reference)
        cache: dict = {}

        def get(layout: str):
            if layout not in cache:
                cache[layout] = run_layout(layout, tensors, ref)
            return cache[layout]

        return get

    return layout_results
