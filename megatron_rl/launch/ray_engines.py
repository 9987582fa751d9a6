"""``rollout.engine_nodes`` under ``launch.scheduler=ray``: one actor per engine node, which runs the engine host.

Place in the data flow: ``launch/ray_run.py`` starts these once the placement group is ready, beside the rank
actors. Engine node ``n`` (``layout.nodes <= n < layout.all_nodes``, bundle ``n``: STRICT_SPREAD keeps it off the
trainer's Ray nodes) gets an actor ``megatron_rl-engine_node<n>`` holding its engines' CPUs and GPUs
(``Layout.engine_bundles``). The actor starts, as its child, the engine host a Slurm or by-hand engine node runs
(``python -m megatron_rl.inference.vllm.engine_host --nodes <all> --engine-nodes K --node-rank n``, with
``MASTER_ADDR/PORT`` = the ranks' rendezvous: rank 0's store), which waits for global rank 0's settings, starts
that node's ``vllm serve`` processes (its children: they die with it) and replaces them when rank 0 asks: the
fleet's routing, weight sync and healing are the code that runs under torchrun (``inference/vllm/engine_nodes.py``).
Its output goes to the driver's and to ``<logging.output_dir>/ray_logs/engine_node_<n>.log``.

Failures: an engine process that dies is the fleet's to replace (rank 0 asks the host, as under torchrun). An engine
host actor that dies (killed, its node gone: Ray then moves the bundle), or a host that ends with an error while
the ranks run, is replaced by a new actor in the same bundle (one line, at most ``MAX_HOST_RESTARTS`` times);
the new host starts the node's engines at the next generation (``engine_host.Host.start``), which rank 0 adopts
when it marks the old ones down (``Fleet.adopt``). The engine hosts end with the run: ``teardown`` stops each host
(SIGINT: it kills its engines) and kills each actor; none is detached.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from megatron_rl.job.paths import REPO_ROOT
from megatron_rl.launch.ray_layout import STOP_GRACE_S, Layout, RayLaunchError, death_reason, last_line
from megatron_rl.launch.ray_rank import RankProcess

ENGINE_ACTOR_NAME = "megatron_rl-engine_node{node}"
MAX_HOST_RESTARTS = 3
"""Engine host actors started again per engine node in one run (then the fleet reports its engines down)."""
USAGE_ERROR = 2
"""The engine host's exit code for a bad command line or config: not restarted."""


class EngineHostProcess(RankProcess):
    """The actor of one engine node: ``RankProcess`` running the engine host (``start`` with its arguments)."""

    def stop(self, grace: float) -> int | None:
        """SIGINT first (the host kills its engines and exits at once), then ``RankProcess.stop``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        return super().stop(grace)


class EngineNodes:
    """The engine host actors of one run (module docstring)."""

    def __init__(self, ray: Any, layout: Layout, pg: Any, env: dict[str, str], log_dir: Path, timeout_s: float) -> None:
        self.ray, self.layout, self.pg, self.env, self.log_dir = ray, layout, pg, env, log_dir
        self.timeout_s = timeout_s
        self.actors: dict[int, Any] = {}
        self.places: dict[int, dict[str, Any]] = {}
        self.restarts = dict.fromkeys(self.nodes(), 0)
        self.ended: set[int] = set()
        self.rendezvous: tuple[str, int] = ("127.0.0.1", 0)

    def nodes(self) -> range:
        return range(self.layout.nodes, self.layout.all_nodes)

    def start(self, master: str, port: int) -> None:
        """One actor per engine node, each running its engine host (RayLaunchError when one cannot start)."""
        self.rendezvous = (master, port)
        for node in self.nodes():
            self._start(node)

    def _start(self, node: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.layout.bundles()[node]
        generation = self.restarts[node]
        name = ENGINE_ACTOR_NAME.format(node=node) + (f"-{generation}" if generation else "")
        actor = self.ray.remote(EngineHostProcess).options(
            name=name, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node)
        ).remote(node)
        self.actors[node] = actor
        try:
            place = self.places[node] = self.ray.get(actor.place.remote(), timeout=self.timeout_s)
            master, port = self.rendezvous
            env = {**self.env, "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "CUDA_VISIBLE_DEVICES": ",".join(place["gpus"])}
            args = ["-m", "megatron_rl.inference.vllm.engine_host", "--nodes", str(self.layout.all_nodes),
                    "--engine-nodes", str(len(self.layout.engine_bundles)), "--node-rank", str(node)]
            self.ray.get(actor.start.remote(args, env, str(REPO_ROOT), str(self.log_dir / f"engine_node_{node}.log")),
                         timeout=self.timeout_s)
        except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError) as err:
            raise RayLaunchError(f"run_megatron.sh: the engine host of node {node} did not start on the Ray cluster "
                                 f"({last_line(err)})") from None

    def where(self, node: int) -> str:
        place = self.places.get(node, {})
        return (f"engine node {node} (Ray node {place.get('ip', '?')} {str(place.get('node_id', '?'))[:8]}, host "
                f"{place.get('host', '?')})")

    def poll(self) -> list[tuple[str, bytes]]:
        """Each host's output since the last call; a host whose actor died or that failed is replaced (module
        docstring)."""
        output: list[tuple[str, bytes]] = []
        for node in [n for n in self.actors if n not in self.ended]:
            try:
                chunks, code, _ = self.ray.get(self.actors[node].poll.remote())
            except self.ray.exceptions.ActorUnavailableError:
                continue
            except self.ray.exceptions.RayActorError as err:
                self._replace(node, f"its actor died: {death_reason(err)}")
                continue
            output += chunks
            if code in (None, 0, USAGE_ERROR):  # running; the fleet closed; a usage error (its line is echoed)
                self.ended.update([node] if code is not None else [])
                continue
            self._replace(node, f"the engine host exited with code {code}")
        return output

    def _replace(self, node: int, why: str) -> None:
        if self.restarts[node] >= MAX_HOST_RESTARTS:
            self.ended.add(node)
            print(f"run_megatron.sh: the engine host of {self.where(node)} is down ({why}) and was started "
                  f"{MAX_HOST_RESTARTS} times already; its engines stay down", file=sys.stderr, flush=True)
            return
        print(f"run_megatron.sh: the engine host of {self.where(node)} is down ({why}); starting it again in its "
              "bundle (its engines rejoin the fleet at the next weight sync)", file=sys.stderr, flush=True)
        self._kill(node)
        self.restarts[node] += 1
        try:
            self._start(node)
        except RayLaunchError as err:  # e.g. its node gone and no other with room: the run goes on without it
            self.ended.add(node)
            print(f"{err}; its engines stay down", file=sys.stderr, flush=True)
            return
        print(f"run_megatron.sh: engine host of node {node} started again on {self.where(node)}", flush=True)

    def _kill(self, node: int) -> None:
        try:
            self.ray.kill(self.actors[node], no_restart=True)
        except Exception:  # noqa: BLE001 (dead already)
            pass

    def teardown(self) -> None:
        """Every host stopped (its engines with it), every actor killed (errors of the dead ignored)."""
        refs = []
        for node, actor in self.actors.items():
            try:
                refs.append(actor.stop.remote(STOP_GRACE_S))
            except Exception:  # noqa: BLE001
                pass
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=2 * STOP_GRACE_S + 5)
        except Exception:  # noqa: BLE001
            pass
        for node in self.actors:
            self._kill(node)
