"""Multi-rank test harness: run a function on N gloo ranks of this machine and collect the results.

    from tests.support.multirank import run_ranks  # the repository root is on sys.path (pytest.ini: pythonpath)

    def _check(rank, world_size, arg):         # module-level, so a spawned child can import it
        groups = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=1)
        ...
        return {"loss": 1.0}                   # anything picklable (tensors: .detach() them)

    results = run_ranks(2, _check, arg)        # [result of rank 0, result of rank 1]

Each rank is a fresh ``spawn`` process with ``RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT`` set
(a free localhost port per call) and ``OMP_NUM_THREADS=1``; ``fn`` initializes the process group itself
(normally through ``megatron_rl.distributed.bootstrap.initialize_distributed``, which reads that env).
After ``fn`` returns or raises, the harness calls ``destroy_distributed()`` in the child if a process group
is still alive, so ``fn`` need not (doing it twice is harmless).

A child exception is re-raised in the parent as ``RuntimeError`` carrying the child's traceback; the other
ranks are then killed (they would block in a collective). A run longer than ``timeout`` seconds kills every
child and raises ``TimeoutError``.

Start-up cost: a rank that imports torch, megatron-core and mbridge pays ~8-14 s of CPU (docs/TESTING.md section
1). CPU-only ranks (the default) are therefore forked from a ``forkserver`` that imported those once per pytest
session (``PRELOAD``); each rank still gets this process's current environment, ``sys.path`` and working
directory, as a spawned one would. GPU ranks (``cpu_only=False``) and ``MEGATRON_RL_TEST_SPAWN=1`` use plain
``spawn`` (a process that has touched CUDA must not fork). Still, group many checks into one spawn.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import time
import traceback
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

from megatron_rl.inference.vllm.server import free_port  # the tests' ports: below the kernel's
# ephemeral range, where another test's outgoing connection cannot take one before the ranks bind it (CI:
# "EADDRINUSE" for a job's MASTER_PORT from bind(0))


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Temporarily set environment variables (spawned children inherit the parent's environ at start)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


PRELOAD = ["torch", "megatron.core", "megatron_rl.model.policy", "megatron_rl.trainer", "megatron_rl.checkpoint.dist",
           "megatron_rl.hf"]
"""What the forkserver imports once, so that forked ranks do not (an import that fails there is skipped)."""

SPAWN_ENV = "MEGATRON_RL_TEST_SPAWN"
"""``=1``: every rank is a fresh ``spawn`` process (the forkserver's preloaded state ruled out when debugging)."""

_forkserver_started = False


def _context(cpu_only: bool):
    """``forkserver`` with ``PRELOAD`` for CPU-only ranks, else ``spawn`` (module docstring)."""
    global _forkserver_started
    if not cpu_only or os.environ.get(SPAWN_ENV) == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _forkserver_started:
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver_started = True
    return ctx


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any,
           environ: dict[str, str]) -> None:
    """Body of one spawned rank: run fn, report ("ok", result) or ("error", traceback), clean up."""
    os.environ.clear()  # a forked rank has the forkserver's environment: take the caller's, as spawn would
    os.environ.update(environ)
    os.environ.update(_rank_env(rank, world_size, port))
    import multiprocessing

    import torch

    # Children are started daemonic (killed with the parent), but dist_checkpointing's saver starts helper
    # processes, which a daemonic process may not: clear the flag inside the child.
    multiprocessing.current_process().daemon = False

    torch.set_num_threads(1)
    try:
        # Plain pickle (a copy): torch's queue reductions would share tensors through the child's shared
        # memory, which is gone once the child exits (EOFError in the parent).
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - everything must reach the parent, incl. SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        _destroy_if_initialized()
        for helper in multiprocessing.active_children():  # e.g. dist_checkpointing's saver helpers
            helper.terminate()


def _destroy_if_initialized() -> None:
    """destroy_distributed() if fn used megatron, else just the process group (no megatron import cost)."""
    import sys

    import torch.distributed as dist

    if "megatron.core.parallel_state" in sys.modules:
        from megatron_rl.distributed.bootstrap import destroy_distributed

        destroy_distributed()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _kill(procs: list) -> None:
    """Kill the ranks and their descendants (e.g. dist_checkpointing's saver helpers, which would otherwise be
    orphaned and keep pytest's output pipe open)."""
    import psutil

    for proc in procs:
        if not proc.is_alive():
            continue
        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        proc.kill()
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    for proc in procs:
        proc.join(timeout=5)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
              cpu_only: bool = True) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; results in rank order.

    ``fn`` must be a module-level (importable) function and its result picklable. Raises ``RuntimeError``
    with the child's traceback if a rank fails or dies, ``TimeoutError`` after ``timeout`` seconds; in both
    cases every child is killed first. ``cpu_only`` (the default) hides GPUs from the ranks, so multi-rank
    tests are CPU/gloo tests everywhere (on a 1-GPU machine NCCL ranks would all land on cuda:0); GPU tests
    pass ``cpu_only=False``.
    """
    assert world_size >= 1, world_size
    ctx = _context(cpu_only)
    results = ctx.Queue()
    port = free_port()
    procs = []
    spawn_env = {"OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu_only else {})}
    with _environ(spawn_env):
        for rank in range(world_size):
            proc = ctx.Process(target=_child, args=(rank, world_size, port, fn, args, results, dict(os.environ)),
                               daemon=True)
            proc.start()
            procs.append(proc)
    try:
        collected = _collect(procs, results, timeout)
    except BaseException:
        _kill(procs)
        raise
    for proc in procs:
        proc.join(timeout=30)
    _kill(procs)
    return [collected[rank] for rank in range(world_size)]


def _collect(procs: list, results: Any, timeout: float) -> dict[int, Any]:
    """Wait for one message per rank; fail fast on a child error, a dead child, or the deadline."""
    collected: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(collected) < len(procs):
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(collected))
            raise TimeoutError(f"run_ranks: ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_module.Empty:
            _raise_if_dead(procs, collected, dead_since)
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} of {len(procs)} failed:\n{payload}")
        collected[rank] = pickle.loads(payload)
    return collected


def _raise_if_dead(procs: list, collected: dict[int, Any], dead_since: dict[int, float]) -> None:
    """A child that exited without a message for a few seconds (its message may still be in flight when it
    has just exited) was killed (segfault, OOM) or returned something unpicklable."""
    now = time.monotonic()
    for rank, proc in enumerate(procs):
        if rank in collected or proc.is_alive():
            continue
        if now - dead_since.setdefault(rank, now) > _DEAD_GRACE_S:
            raise RuntimeError(
                f"rank {rank} of {len(procs)} exited (code {proc.exitcode}) without a result; "
                "a killed process, or a result that cannot be pickled"
            )


_DEAD_GRACE_S = 3.0
