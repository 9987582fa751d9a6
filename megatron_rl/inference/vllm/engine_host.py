"""The engine host: what an engine node (``rollout.engine_nodes``) runs instead of torchrun ranks.

    python -m megatron_rl.inference.vllm.engine_host --nodes N --engine-nodes K --node-rank R   (run_megatron.sh)

Place in the data flow: ``run_megatron.sh`` on one of the job's last K nodes runs this (no torchrun, no rank, no
process group); under ``launch.scheduler=ray`` an actor per engine node runs it (``launch/ray_engines.py``) and
starts a new one should it die. It waits on torchrun's store (``engine_nodes.py``) until global rank 0 publishes the engines'
settings, starts this node's engines (``nodes.engines_on_node``: engine i on node ``N - K + i % K``) exactly as a
node's local rank 0 does on a trainer node (``vllm/launcher.py: Launcher``: its share of the cores or its devices, a
watchdog on this process's pid, ``<work_dir>/engine<i>.log``), tells rank 0 their URLs, and from then on replaces
an engine whenever rank 0 asks (the fleet's healing).

It ends when the job does: rank 0 closes the fleet (``done``), or the first node's launcher, which serves the
store, is gone; its engines are killed on the way out (and die with it anyway: their watchdog). SIGUSR1 or
SIGTERM (a preemption) does not stop it: the trainer saves at its next step boundary, which may need the engines,
then ends the job; the host then exits with code 3 like the trainer's nodes. SIGINT (Ctrl-C) stops it at once.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from megatron_rl.distributed.preemption import EXIT_CODE, STOP_SIGNALS
from megatron_rl.inference.vllm.engine_nodes import POLL_S, PREFIX, connect_store, url_key
from megatron_rl.inference.nodes import NodeLayout, check_engine_nodes, engine_host, engines_on_node
from megatron_rl.inference.vllm.server import EngineServer, ServeOptions

CONNECT_TIMEOUT_S = 900.0
"""How long the host waits for the first node's launcher (its store) to come up."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.inference.vllm.engine_host",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True, help="the job's nodes, engine nodes included (NNODES)")
    parser.add_argument("--engine-nodes", type=int, required=True, help="rollout.engine_nodes")
    parser.add_argument("--node-rank", type=int, required=True, help="this node (NODE_RANK)")
    return parser.parse_args(argv)


class Host:
    """This node's engines (module docstring)."""

    def __init__(self, store, spec: dict, node: int, all_nodes: int) -> None:
        from megatron_rl.inference.vllm.launcher import Launcher

        self.store = store
        layout = NodeLayout(node=node, nnodes=spec["trainer_nodes"])
        self.launcher = Launcher(ServeOptions(**spec["options"]), Path(spec["model_dir"]), Path(spec["work_dir"]),
                                 spec["token"], spec["num_engines"], layout,
                                 engine_host(spec["engine_host"], all_nodes), engine_nodes=spec["engine_nodes"])
        self.mine = engines_on_node(spec["num_engines"], node, spec["trainer_nodes"], spec["engine_nodes"])
        self.servers: dict[int, EngineServer] = {}
        self.generations = dict.fromkeys(self.mine, 0)

    def start(self) -> None:
        """This node's engines, each at the generation rank 0 asked for last; at the next one when a host before
        this one answered that already (it died and this one replaces it: ``launch/ray_engines.py``): rank 0
        adopts it when it asks for a replacement."""
        for index in self.mine:
            generation = self.store.add(f"{PREFIX}restart/{index}", 0)
            self.generations[index] = generation + int(self.store.check([url_key(index, generation)]))
            self._launch(index)

    def _launch(self, index: int) -> None:
        old = self.servers.pop(index, None)
        if old is not None:
            old.kill()
        server = self.servers[index] = self.launcher.launch(index)
        self.store.set(url_key(index, self.generations[index]), server.url)

    def serve(self) -> None:
        """Replace the engines rank 0 asks for, until it says ``done`` (the store raises once it is gone)."""
        while not self.store.check([PREFIX + "done"]):
            for index in self.mine:
                wanted = self.store.add(f"{PREFIX}restart/{index}", 0)
                if wanted > self.generations[index]:
                    self.generations[index] = wanted
                    self._launch(index)
            time.sleep(POLL_S)

    def close(self) -> None:
        for server in self.servers.values():
            server.kill()
        self.servers = {}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        check_engine_nodes(args.engine_nodes, args.engine_nodes, args.nodes)
        if not args.nodes - args.engine_nodes <= args.node_rank < args.nodes:
            raise ValueError(f"NODE_RANK={args.node_rank} is not one of the {args.engine_nodes} engine node(s) "
                             f"{args.nodes - args.engine_nodes}..{args.nodes - 1} (rollout.engine_nodes)")
    except ValueError as err:
        print(f"megatron_rl engine host: {err}", file=sys.stderr)
        return 2
    stopping: list[str] = []

    def on_stop(signum: int, _frame: object) -> None:
        stopping.append(signal.Signals(signum).name)
        print(f"megatron_rl engine host: got {stopping[-1]}: serving until the trainer has saved and stopped",
              file=sys.stderr, flush=True)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop)
    print(f"megatron_rl engine host (node {args.node_rank}): waiting for the trainer's rank 0 "
          f"({args.nodes - args.engine_nodes} trainer node(s))", flush=True)
    return run(args, stopping)


def run(args: argparse.Namespace, stopping: list[str]) -> int:
    host = store = None
    try:
        store = connect_store(CONNECT_TIMEOUT_S)
        while not store.check([PREFIX + "spec"]):
            time.sleep(POLL_S)
        host = Host(store, json.loads(store.get(PREFIX + "spec")), args.node_rank, args.nodes)
        host.start()
        print(f"megatron_rl engine host (node {args.node_rank}): started engine(s) {host.mine} "
              f"(logs: {host.launcher.work_dir}/engine<i>.log)", flush=True)
        host.serve()
        code = 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - the store is gone: the first node's launcher ended
        if store is None:
            print(f"megatron_rl engine host: no trainer's store at $MASTER_ADDR:$MASTER_PORT within "
                  f"{CONNECT_TIMEOUT_S:.0f} s ({err}): is node 0 running `bash run_megatron.sh` with the same "
                  "MASTER_ADDR/MASTER_PORT?", file=sys.stderr)
            return 1
        if host is None:  # the trainer's launcher ended before its rank 0 started the engines: it says why
            return EXIT_CODE if stopping else 1
        code = 0  # the job ended without closing the fleet (a crash or a stop): the trainer's nodes report it
    finally:
        if host is not None:
            host.close()
    return EXIT_CODE if stopping else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
