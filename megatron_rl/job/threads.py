"""OpenMP threads per rank: the cores this node's ranks (and its engines) leave free, unless OMP_NUM_THREADS says.

``run_megatron.sh`` runs ``python -m megatron_rl.job.threads NPROC --config FILE ... key=value ...`` (stdlib and
pyyaml only, like ``job/paths.py``) and exports the first word it prints as ``OMP_NUM_THREADS``; the whole line
is said on the launcher's own first line. The rule (issue 53: with one rank on a 2-core machine a pinned thread
left a core idle):

    threads = max(1, (cores - busy cores - engine cores) // ranks on this node), and 1 for a model of hidden size
              < SMALL_HIDDEN (model.hidden_size, or the checkpoint's config.json)

``cores``: the CPUs this process may run on (``os.sched_getaffinity``). Busy cores: the 1-minute load average
rounded down (other work on a shared machine: on the 2-core box at load ~28 two threads per rank made the tiny
step 22x slower than one, 8.6 against 0.39 s, because OpenMP threads that find no free core spin). Engine cores:
one per vLLM engine this node starts when the engines generate while the ranks train (``rollout.max_staleness``
> 0); a synchronous engine's threads sleep while the ranks train (W47), so it reserves none. The built-in engine
is the ranks themselves. ``OMP_NUM_THREADS`` in the environment wins (a positive integer; anything else is
refused). The launcher also exports ``OMP_WAIT_POLICY=PASSIVE`` unless set (idle threads sleep, as the engines'
do: W47).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

OVERRIDE = "OMP_NUM_THREADS"


def busy_cores() -> int:
    """Cores other work keeps busy: the 1-minute load average, rounded down (0 where unknown)."""
    try:
        return int(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0


def usable_cores() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def engine_cores(flat: dict, nnodes: int, node: int) -> int:
    """Cores the engines this node starts keep busy while the ranks train (one per concurrent vLLM engine)."""
    if int(flat.get("rollout.max_staleness", 0) or 0) == 0:
        return 0
    from megatron_rl.inference.registry import ENGINES  # (light: no torch) the shipped engines' declarations

    entry = ENGINES.get(flat.get("rollout.engine", "builtin"))  # one of rollout.engine_module's: not counted
    if entry is None or not (entry.capabilities.own_weights and entry.capabilities.concurrent):
        return 0  # it samples in the ranks themselves (the built-in engine)
    from megatron_rl.inference.nodes import engines_on_node

    engine_nodes = int(flat.get("rollout.engine_nodes", 0) or 0)  # (NNODES: the trainer's nodes, launch/placement.py)
    return len(engines_on_node(int(flat.get("rollout.num_engines", 1)), node, max(1, nnodes), engine_nodes))


SMALL_HIDDEN = 256
"""A model with a hidden size below this gets one thread per rank: its ops are too small to split, and the
passive OpenMP threads' wake-ups cost more than they give (BENCHMARKS.md section 12, fourth round: the 86k-param
job, hidden 64, on the quiet 2-core box: 0.138-0.151 s a step with 1 thread, 0.229-0.287 s with 2 passive ones;
2 active ones 0.138, but active threads spin on a loaded machine: W47). Sizes between 64 and 256 were not measured."""


def hidden_size(flat: dict) -> int | None:
    """The model's hidden size: ``model.hidden_size`` when given, else its checkpoint's config.json (the text
    config's for a multimodal one); None when neither says."""
    if flat.get("model.hidden_size"):
        return int(flat["model.hidden_size"])
    path = flat.get("model.hf_path")
    if not path:
        return None
    try:
        import json

        with open(os.path.join(os.path.expanduser(str(path)), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    return int(value) if isinstance(value, int) else None


def threads_per_rank(cores: int, ranks: int, reserved: int = 0) -> int:
    """The rule of the module doc."""
    return max(1, (cores - reserved) // max(1, ranks))


def describe(nproc: int, flat: dict, env: dict | None = None) -> str:
    """``"<n> OpenMP thread(s) per rank (<why>)"``: the launcher exports the first word and says the line."""
    env = os.environ if env is None else env
    given = env.get(OVERRIDE)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{OVERRIDE}={given!r} is not a positive integer; unset it (threads are derived from the "
                             "free cores) or give a number")
        return f"{int(given)} OpenMP thread(s) per rank ({OVERRIDE})"
    cores, busy = usable_cores(), min(busy_cores(), usable_cores())
    reserved = engine_cores(flat, int(env.get("NNODES", "1") or 1), int(env.get("NODE_RANK", "0") or 0))
    threads = threads_per_rank(cores, nproc, busy + reserved)
    less = "".join(f" less {n} {why}" for n, why in ((busy, "busy (load average)"), (reserved, "for the engines")) if n)
    hidden = hidden_size(flat)
    if threads > 1 and hidden is not None and hidden < SMALL_HIDDEN:
        return (f"1 OpenMP thread(s) per rank (a model of hidden size {hidden} < {SMALL_HIDDEN}: its ops are too small "
                f"to split; {OVERRIDE}=N overrides)")
    return f"{threads} OpenMP thread(s) per rank ({cores} core(s){less} / {nproc} rank(s); {OVERRIDE}=N overrides)"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_rl.job.threads NPROC [--config FILE ...] [key=value ...]``: prints ``describe``."""
    from megatron_rl.config_files import ConfigError, config_arguments, read_overrides

    args = list(sys.argv[1:] if argv is None else argv)
    nproc = int(args[0]) if args and args[0].isdigit() else 1
    files, overrides = config_arguments(args[1:])
    try:
        print(describe(nproc, read_overrides(files, overrides)))
    except (ValueError, ConfigError) as err:
        print(f"run_megatron.sh: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
