"""Run a function on global rank 0 only and hand its result (or its exception) to every rank.

Place in the data flow: work that exists once per job, on the rank that owns the rollout fleet, inside a call
every rank makes collectively (e.g. ``environments/agent``: the agent threads and their HTTP endpoint run on
rank 0, every rank trains on the same rollouts). Without an initialized process group (one process) the function
simply runs.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


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
    dist.broadcast_object_list(payload, src=0)
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
