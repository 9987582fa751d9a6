"""Run a function on global rank 0 only and hand its result (or its exception) to every rank.

Place in the data flow: work that exists once per job, on the rank that owns the rollout fleet, inside a call
every rank makes collectively (e.g. ``environments/agent``: the agent threads and their HTTP endpoint run on
rank 0, every rank trains on the same rollouts). Without an initialized process group (one process) the function
simply runs.

Collectives issued from a rollout thread (the main job's rollouts generated ahead of training,
``job/pipeline.py``) must not share a process group with the training running on the main thread at the same
time: ``collectives_on(group)`` makes this thread's ``on_rank0`` and ``broadcast_from_rank0`` use ``group``
(a dedicated gloo group over every rank) instead of the default one.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_local = threading.local()


@contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """This thread's rank-0 broadcasts (``on_rank0``, ``broadcast_from_rank0``) go over ``group`` while inside."""
    previous = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = previous


def new_thread_group() -> Any:
    """A gloo group over every rank for one thread's ``collectives_on`` (collective: every rank calls it in the
    same order); None in one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(backend="gloo")
    return None


def current_group() -> Any:
    """The process group this thread's rank-0 broadcasts use (None = the default group)."""
    return getattr(_local, "group", None)


def is_global_rank0() -> bool:
    """True on global rank 0, and in one process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def union_over_ranks(values: set) -> set:
    """The union of every rank's ``values`` (collective over this thread's group; the set itself in one
    process): what one rank found, every rank acts on."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return set(values)
    gathered: list = [None] * dist.get_world_size(group=current_group())
    dist.all_gather_object(gathered, sorted(values), group=current_group())
    return {v for part in gathered for v in part}


def broadcast_from_rank0(payload: list) -> list:
    """``dist.broadcast_object_list(payload, src=0)`` over this thread's group (a no-op in one process); returns
    ``payload`` (filled in place on the other ranks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0, group=current_group())
    return payload


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` on global rank 0, its result broadcast to every rank (collective: every rank calls this). An
    exception on rank 0 is raised on every rank (the same type and message where it pickles, else a
    ``RuntimeError`` naming it), so no rank is left waiting."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    payload: list = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload = [("ok", fn())]
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
            payload = [("error", _portable(err))]
    broadcast_from_rank0(payload)
    status, value = payload[0]
    if error is not None:
        raise error
    if status == "error":
        raise value
    return value


def _portable(err: Exception) -> Exception:
    try:
        return pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any exception that does not survive pickling
        return RuntimeError(f"on global rank 0: {type(err).__name__}: {err}")
