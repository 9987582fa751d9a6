"""Engines on nodes of their own (``rollout.engine_nodes``): how global rank 0 and the engine hosts talk.

Place in the data flow: ``vllm/engine.py: VLLMEngine.start`` (rank 0) publishes what an engine needs (``EngineHosts``:
the serve options, model and work directories, the job's token) and takes back each engine's URL; the engine
host of each engine node (``inference/vllm/engine_host.py``, started by ``run_megatron.sh`` there instead of
torchrun, or by its actor under Ray: ``launch/ray_engines.py``)
starts its engines (``nodes.engines_on_node``) and answers restart requests. Healing is unchanged: rank 0 marks an
engine-node engine down like another node's engine, and at the next collective point (``_restart_remote``) asks
its host for a replacement here instead of a torchrun rank.

The channel is torchrun's own rendezvous store (a ``TCPStore`` at ``$MASTER_ADDR:$MASTER_PORT``, served by the
first node's launcher for the whole job; under Ray, with no launcher, by rank 0's process group: ``env://``), under ``PREFIX``: the engine hosts are not ranks of the process group,
so the trainer's collectives, world size and DP stay those of the trainer nodes. Keys: ``spec`` (JSON, set once
by rank 0), ``url/<i>/<g>`` (set by the host: generation ``g`` of engine ``i``), ``restart/<i>`` (a counter rank 0
raises: the generation it asks for), ``done`` (rank 0 closed the fleet: the hosts kill their engines and exit).
When the first node's launcher ends, the store goes with it and the hosts end too.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict
from typing import Any

PREFIX = "megatron_rl/engine_nodes/"
POLL_S = 0.5


def connect_store(timeout_s: float) -> Any:
    """A client of torchrun's store at ``$MASTER_ADDR:$MASTER_PORT`` (waits up to ``timeout_s`` for it)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def url_key(index: int, generation: int) -> str:
    return f"{PREFIX}url/{index}/{generation}"


def wait_key(store: Any, key: str, timeout_s: float) -> bytes | None:
    """The value of ``key`` once set, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return store.get(key)


class EngineHosts:
    """Rank 0's side: the engines of the engine nodes (module docstring)."""

    def __init__(self, store: Any, num_engines: int, timeout_s: float) -> None:
        self.store = store
        self.num_engines = num_engines
        self.timeout_s = timeout_s

    @classmethod
    def publish(cls, launcher: Any, engine_host: str, timeout_s: float) -> "EngineHosts":
        """Tell the engine hosts what to start (``launcher``: ``vllm/launcher.py: Launcher``; ``engine_host``:
        ``rollout.engine_host``, each host resolves it itself)."""
        spec = {"options": asdict(launcher.options), "model_dir": str(launcher.model_dir),
                "work_dir": str(launcher.work_dir), "token": launcher.token, "num_engines": launcher.num_engines,
                "trainer_nodes": launcher.layout.nnodes, "engine_nodes": launcher.engine_nodes,
                "engine_host": engine_host, "timeout_s": timeout_s}
        try:
            store = connect_store(timeout_s)
            store.set(PREFIX + "spec", json.dumps(spec))
        except Exception as err:  # noqa: BLE001 - torch's store errors have no common type
            from megatron_rl.inference.engine import EngineStartError

            raise EngineStartError(f"rollout.engine_nodes: torchrun's store at $MASTER_ADDR:$MASTER_PORT, where the "
                                   f"engine hosts wait, is not reachable ({err})") from None
        return cls(store, launcher.num_engines, timeout_s)

    def urls(self) -> dict[int, str]:
        """Every engine's first URL (EngineStartError naming the engine host when one does not answer)."""
        return {i: self._url(i, 0) for i in range(self.num_engines)}

    def restart(self, indices: list[int]) -> dict[int, str]:
        """Ask the hosts of ``indices`` for replacements; their URLs (one that did not come is unreachable, and
        the fleet's usual failure path restarts it again)."""
        return {i: self._url(i, self.store.add(f"{PREFIX}restart/{i}", 1), required=False) for i in indices}

    def _url(self, index: int, generation: int, *, required: bool = True) -> str:
        from megatron_rl.inference.engine import EngineStartError

        value = wait_key(self.store, url_key(index, generation), self.timeout_s)
        if value is not None:
            return value.decode()
        if required:
            raise EngineStartError(f"the engine host of engine {index} (rollout.engine_nodes) started no engine within "
                                   f"{self.timeout_s:.0f} s (rollout.start_timeout_s): is `bash run_megatron.sh` running "
                                   "on every engine node, with the same MASTER_ADDR/MASTER_PORT, NNODES and config?")
        return "http://engine-host-did-not-answer.invalid:9"

    def close(self) -> None:
        try:
            self.store.set(PREFIX + "done", "1")
        except Exception:  # noqa: BLE001 - the store's launcher is gone: so are the hosts
            pass
