"""Which engines take part in the weight sync (collective): the sync store, the other nodes' restarts, and the
admission of the engines that are up but not serving yet (they join the sync groups, get the current weights,
then serve).

Place in the data flow: a part of ``VLLMEngine`` (``engine.py``): at start (every engine joins), before each
weight sync (the replacements that came up since the last one), and when no engine serves (``generate``, an
agent's waiting calls: ``admit_replacements``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch.distributed as dist

from megatron_rl.inference.engine import EngineError
from megatron_rl.inference.nodes import LOOPBACK, NodeLayout, engine_node
from megatron_rl.inference.vllm.collective import gather_urls, raise_everywhere
from megatron_rl.inference.vllm.server import EngineServer


class Membership:
    """The membership half of ``VLLMEngine`` (``engine.py``, whose constructor sets these attributes)."""

    config: Any
    groups: Any
    fleet: Any
    store: Any
    sender: Any
    transport: str
    version: int
    layout: NodeLayout
    launcher: Any
    own: dict[int, EngineServer]

    def _connect_store(self) -> None:
        from megatron_rl.inference.vllm.weight_sync import WeightSender

        self.sender = WeightSender(self.groups, bucket_bytes=int(self.config.bucket_mb * 2**20),
                                   backend=self.transport if self.transport != "disk" else "gloo")
        if self.transport == "disk":
            return
        port = [0]
        if self.groups.rank == 0:
            self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        dist.broadcast_object_list(port, src=0)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if self.groups.world_size > 1 else "127.0.0.1"
        self.sender.connect(host, port[0], timeout_s=self.config.start_timeout_s)

    def _restart_remote(self) -> None:
        """Collective (multi-node jobs): the owners of the other nodes' engines that rank 0 saw go down kill them
        and start replacements; rank 0 waits for those in the background (they join at a later ``_admit``)."""
        if self.layout.nnodes == 1 and not self.config.engine_nodes:
            return
        payload = [self.fleet.remote_restarts() if self.fleet is not None else []]
        dist.broadcast_object_list(payload, src=0)
        if not payload[0]:
            return
        mine = [i for i in payload[0] if engine_node(i, self.layout.nnodes, self.config.engine_nodes) == self.layout.node]
        if self.launcher is not None:
            for index in mine:
                self.own.pop(index).kill()
                self.own[index] = self.launcher.launch(index)
        urls = gather_urls({i: self.own[i] for i in mine} if self.launcher is not None else {})
        if self.hosts is not None:
            urls.update(self.hosts.restart(payload[0]))
        if self.fleet is not None:
            for index, url in urls.items():
                self.fleet.adopt(index, url)

    def _admit(self, *, send: bool = False) -> None:
        """Collective: the engines that are up but not serving join the weight sync (and, with ``send``, get the
        current weights); then they serve."""
        self._restart_remote()
        joining = [[s.index, s.prefix] for s in self.fleet.ready_to_join()] if self.fleet is not None else []
        payload = [joining]
        if self.groups.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        joining = payload[0]
        if not joining:
            return
        if self.transport != "disk":
            self._join(joining)
        if send and self.version > 0:
            self._sync([index for index, _ in joining])
        if self.fleet is not None:
            joined = [self.fleet.slots[i] for i, _ in joining if self.fleet.slots[i].state == "joining"]
            for slot in joined:  # (one that died during its sync was marked down: it is replaced again)
                slot.state = "serving"
                if slot.down_since is not None:  # a replacement: say that it came back
                    print(f"megatron_rl: vLLM engine {slot.index} is back after "
                          f"{time.monotonic() - slot.down_since:.0f} s (a replacement, serving with the current "
                          "weights)", flush=True)
                    slot.down_since = None
            if send and self.config.partial_rollouts:  # label their tokens with the version they were given
                self._label_version(joined)

    def _join(self, joining: list) -> None:
        """Collective: the senders and the workers of each engine in ``joining`` form that engine's groups."""
        timeout = self.config.start_timeout_s
        deadline = self.config.sync_timeout_s  # of each broadcast of the groups formed here
        errors: dict[int, Any] = {}
        worker = None
        if self.fleet is not None:
            slots = [self.fleet.slots[index] for index, _ in joining]
            host = LOOPBACK if self.layout.nnodes == 1 and not self.config.engine_nodes else os.environ.get(
                "MASTER_ADDR", LOOPBACK)  # rank 0's store
            workers = self.config.engine_tensor_parallel_size
            call = lambda slot: slot.server.collective_rpc(  # noqa: E731
                "megatron_rl_join", host, self.store.port, slot.prefix, self.groups.pp_size, workers, self.transport,
                deadline, timeout_s=timeout)
            worker = threading.Thread(target=lambda: errors.update(self.fleet.each(slots, call)), daemon=True)
            worker.start()
        for _, prefix in joining:
            self.sender.join(prefix, num_workers=self.config.engine_tensor_parallel_size, timeout_s=deadline)
        if worker is not None:
            worker.join()
        error = next((f"{self.fleet.slots[i].name} could not join the weight sync: {e}"
                      for i, e in errors.items() if isinstance(e, Exception)), None)
        raise_everywhere(error, EngineError)

