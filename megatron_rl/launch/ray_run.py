"""The run on the Ray cluster: reserve the placement group, start the rank actors, supervise them, end them all.

Place in the data flow: ``launch/ray_driver.py`` (the driver: config, pre-flight, joining the cluster) builds a
``RayRun`` and calls ``run()``; the actors are ``launch/ray_rank.py``'s ``RankProcess``. The outcome follows
torchrun's launch (``distributed/launch.py``):

    every rank exits 0                       exit 0
    a rank fails                             the others get FAILURE_GRACE_S to end (and report), then SIGTERM;
                                             the lowest rank's reported line once, with its code; else one line
                                             naming the first failed rank, its node, exit code and log
    a rank actor dies (killed, node lost)    one line naming the rank and its node; the others are ended; exit 1
    Ctrl-C / SIGTERM of the driver           SIGINT to every rank (each stops at a step boundary and says what it
                                             kept: the reported line), exit 130; a second Ctrl-C ends them at once

With ``rollout.engine_nodes`` the engine nodes' actors (``ray_engines.py``) start with the ranks, are polled
with them (an engine host that is down is replaced, the run goes on) and end after them.

``teardown`` always runs: each rank is stopped (SIGTERM, then SIGKILL), each engine host (SIGINT first), each
actor killed, the placement group removed. Should this process be killed outright, Ray ends its actors (they are
not detached) and each rank and engine host dies with its actor.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.job.launch_config import LaunchConfig
from megatron_rl.job.paths import REPO_ROOT
from megatron_rl.launch.ray_engines import EngineNodes
from megatron_rl.launch.ray_layout import (ACTOR_NAME, FAILURE_GRACE_S, INTERRUPT_GRACE_S, POLL_S, STOP_GRACE_S,
                                           Layout, RayLaunchError, death_reason, last_line,
                                           visible_devices)
from megatron_rl.launch.ray_rank import RankProcess


class RankDied(Exception):
    """A rank's actor is gone (``ray.exceptions.RayActorError``)."""

    def __init__(self, rank: int, err: Exception) -> None:
        super().__init__(rank)
        self.rank, self.err = rank, err


class RayRun:
    """One run's placement group and rank actors (module docstring)."""

    def __init__(self, ray: Any, layout: Layout, launch: LaunchConfig, argv: Sequence[str], log_dir: Path,
                 env: dict[str, str]) -> None:
        self.ray, self.layout, self.launch, self.argv = ray, layout, launch, list(argv)
        self.log_dir, self.env = log_dir, env
        self.pg: Any = None
        self.actors: list[Any] = []
        self.places: list[dict[str, Any]] = []
        self.running: set[int] = set()
        self.codes: dict[int, int] = {}
        self.reported: dict[int, tuple[int, str]] = {}
        self.failed_first: int | None = None
        self.engine_nodes: EngineNodes | None = None
        """``rollout.engine_nodes``: their engine host actors (``ray_engines.py``)."""

    def run(self) -> int:
        try:
            self.reserve()
            self.start_ranks()
            return self.supervise()
        except RayLaunchError as err:
            print(err, file=sys.stderr, flush=True)
            return err.code
        except RankDied as died:
            print(self.died_line(died), file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            return self.interrupted()
        finally:
            self.teardown()

    # -- start -------------------------------------------------------------------------------------------------

    def reserve(self) -> None:
        """The placement group, once the cluster has room for it (else RayLaunchError)."""
        from ray.util.placement_group import placement_group

        layout, timeout = self.layout, self.launch.ray.placement_timeout_s
        self.pg = placement_group(layout.bundles(), strategy=layout.strategy, name=f"megatron_rl-{os.getpid()}")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            nodes = sum(1 for node in self.ray.nodes() if node.get("Alive"))
            free = {k: v for k, v in self.ray.available_resources().items() if k in ("CPU", "GPU")}
            raise RayLaunchError(
                f"run_megatron.sh: the Ray cluster has no room for the bundles {layout.bundles()} ({layout.strategy}: "
                f"each on its own Ray node) after {timeout:g} s (launch.ray.placement_timeout_s); it has {nodes} "
                f"node(s), {free} free: lower launch.nodes, NPROC or launch.ray.cpus_per_rank / gpus_per_rank / "
                "cpus_per_engine / gpus_per_engine, or add nodes")

    def start_ranks(self) -> None:
        """One actor per rank in its node's bundle; each starts its rank once all are placed."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        layout, actor = self.layout, self.ray.remote(RankProcess)
        self.actors = [actor.options(
            name=ACTOR_NAME.format(rank=rank), num_cpus=layout.cpus_per_rank, num_gpus=layout.gpus_per_rank,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=rank // layout.nproc)).remote(rank)
            for rank in range(layout.world)]
        try:
            self.places = self.ray.get([a.place.remote() for a in self.actors])
        except self.ray.exceptions.RayActorError as err:
            raise RayLaunchError(f"run_megatron.sh: the rank actors did not start on the Ray cluster ("
                                 f"{last_line(err)}); every node needs this checkout and venv at the same paths "
                                 "(docs/CLUSTER.md)") from None
        master = self.places[0]["ip"]
        port = int(os.environ.get("MASTER_PORT") or self.ray.get(self.actors[0].free_port.remote()))
        if layout.engine_bundles:  # they wait for rank 0's store at master:port (inference/vllm/engine_nodes.py)
            self.engine_nodes = EngineNodes(self.ray, layout, self.pg, self.env, self.log_dir,
                                            self.launch.ray.placement_timeout_s)
            self.engine_nodes.start(master, port)
        starts = []
        for rank, handle in enumerate(self.actors):
            env = {**self.env, **layout.rank_env(rank, master, port, self.visible(rank))}
            starts.append(handle.start.remote(["-m", "megatron_rl.job.main", *self.argv], env, str(REPO_ROOT),
                                              str(self.log_dir / f"rank_{rank}.log")))
        self.running = set(range(layout.world))  # teardown stops those that did start
        try:
            self.ray.get(starts)
        except self.ray.exceptions.RayError as err:  # e.g. the log folder not writable on a node
            raise RayLaunchError(f"run_megatron.sh: a rank did not start on the Ray cluster ({last_line(err)})") \
                from None
        print(f"run_megatron.sh: Ray placement group {self.pg.id.hex()[:12]} ({layout.strategy}): "
              f"{self.where_all()}; rendezvous at {master}:{port}; each rank's log: "
              f"{self.log_dir / 'rank_<N>.log'}", flush=True)

    def visible(self, rank: int) -> str:
        return visible_devices(self.places, self.layout, rank // self.layout.nproc) if self.layout.gpus_per_rank else ""

    def where(self, rank: int) -> str:
        place = self.places[rank] if rank < len(self.places) else {}
        return (f"node {rank // self.layout.nproc} (Ray node {place.get('ip', '?')} "
                f"{str(place.get('node_id', '?'))[:8]}, host {place.get('host', '?')})")

    def where_all(self) -> str:
        nproc, hosts = self.layout.nproc, self.engine_nodes
        return ", ".join([f"ranks {n * nproc}-{(n + 1) * nproc - 1} on {self.where(n * nproc)}"
                          for n in range(self.layout.nodes)]
                         + ([f"engine host on {hosts.where(n)}" for n in hosts.nodes()] if hosts else []))

    # -- supervise ---------------------------------------------------------------------------------------------

    def poll(self) -> None:
        """One round: print every running rank's new output, note those that ended; the engine hosts' output
        (one that is down is replaced: ``ray_engines.py``)."""
        if self.engine_nodes is not None:
            echo(self.engine_nodes.poll())
        refs = {rank: self.actors[rank].poll.remote() for rank in sorted(self.running)}
        for rank, ref in refs.items():
            try:
                chunks, code, reported = self.ray.get(ref)
            except self.ray.exceptions.ActorUnavailableError:
                continue  # unreachable for now (Ray retries); dead: ActorDiedError below
            except self.ray.exceptions.RayActorError as err:
                self.running.discard(rank)
                raise RankDied(rank, err) from None
            echo(chunks)
            if code is None:
                continue
            self.running.discard(rank)
            self.codes[rank] = code
            if reported:
                self.reported[rank] = reported
            if code and self.failed_first is None:
                self.failed_first = rank

    def supervise(self) -> int:
        failed_at = None
        while self.running:
            self.poll()
            if self.failed_first is not None and self.running:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > FAILURE_GRACE_S:
                    self.stop_ranks()
            time.sleep(POLL_S)
        return self.outcome()

    def outcome(self) -> int:
        if self.reported:
            code, line = self.reported[min(self.reported)]
            print(line, file=sys.stderr, flush=True)
            return code
        if self.failed_first is None:
            return 0
        rank = self.failed_first
        code = self.codes[rank]
        print(f"run_megatron.sh: trainer rank {rank} on {self.where(rank)} exited with code {code}; its full log: "
              f"{self.log_dir / f'rank_{rank}.log'}", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code  # killed by a signal: 128 + its number, as a shell says

    def died_line(self, died: RankDied) -> str:
        return (f"run_megatron.sh: trainer rank {died.rank} (Ray actor {ACTOR_NAME.format(rank=died.rank)}) on "
                f"{self.where(died.rank)} died: {death_reason(died.err)}; the run stopped (the other ranks were "
                "ended); the same command resumes from the last checkpoint")

    def interrupted(self) -> int:
        """Ctrl-C: SIGINT to every rank, as the terminal gives it under torchrun; they stop at a step boundary and
        report what they kept (a second Ctrl-C: stopped at once)."""
        try:
            for rank in sorted(self.running):
                self.actors[rank].signal.remote(signal.SIGINT)
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            while self.running and time.monotonic() < deadline:
                self.poll()
                time.sleep(POLL_S)
        except (KeyboardInterrupt, RankDied):
            pass
        if self.reported:
            code, line = self.reported[min(self.reported)]
            print(line, file=sys.stderr, flush=True)
        return 130

    # -- end ---------------------------------------------------------------------------------------------------

    def stop_ranks(self) -> None:
        refs = [self.actors[rank].stop.remote(STOP_GRACE_S) for rank in sorted(self.running)]
        self.ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)

    def teardown(self) -> None:
        """Every rank stopped, every actor killed, the placement group removed (errors of the dead ignored)."""
        from ray.util.placement_group import remove_placement_group

        try:
            if self.running:
                self.stop_ranks()
        except Exception:  # noqa: BLE001 (a dead actor: its rank died with it)
            pass
        if self.engine_nodes is not None:
            self.engine_nodes.teardown()
        for handle in self.actors:
            try:
                self.ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass


def echo(chunks: Sequence[tuple[str, bytes]]) -> None:
    """A rank's output on this process's stream of the same name, as it came."""
    for name, data in chunks:
        stream = sys.stdout if name == "stdout" else sys.stderr
        stream.buffer.write(data)
        stream.flush()
