"""``rollout.engine`` -> the factory that starts that engine, and what it can do.

Place in the data flow: the job's config checks (``job/config.py``: ``check_engine_config``, when the config is
loaded, in the pre-flight and on every rank) and the job's start (``job/main.py``: ``start_engine``, collective,
on the resumed weights). The only place that knows engines by name: the job, its pipeline and the environments
ask an engine's declared ``capabilities`` (``engine.EngineCapabilities``), never its name.

Two engines ship (``builtin``, ``vllm``); another registers with ``register_engine`` from its own module, which
the job imports on every process that reads the config (the pre-flight, every rank) when
``rollout.engine_module`` names it (``path/to/file.py`` or ``package.module``, loaded as ``reward.function``'s
files are: ``environments/user_code.py``)::

    # my_engine.py
    from megatron_rl.inference.registry import register_engine
    register_engine("mine", start_mine, capabilities=EngineCapabilities(own_weights=True))

    bash run_megatron.sh rollout.engine_module=my_engine.py rollout.engine=mine

A factory is called as ``factory(config, policy, pad_token_id=...)`` with the job's config (``JobConfig``: it
reads the sections it needs), the policy on the weights the run starts from, and the environment's pad id; it
returns a started ``RolloutEngine`` whose ``capabilities`` are the registered ones (collective: every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.config_files import ConfigError
from megatron_rl.inference.engine import EngineCapabilities, EngineStartError, RolloutEngine
from megatron_rl.inference.vllm import CAPABILITIES as VLLM_CAPABILITIES

EngineFactory = Callable[..., RolloutEngine]
"""``factory(config, policy, *, pad_token_id) -> RolloutEngine`` (module docstring); may raise
``EngineStartError`` (the job stops with one line)."""
ConfigCheck = Callable[[Any, Any, str], None]
"""``check(rollout, model, device)``: ``ConfigError`` for a ``rollout`` section or model (``ModelConfig``, the
checkpoint's shapes with ``model.hf_path``) the engine cannot run on ``parallel.device``."""


@dataclass(frozen=True)
class EngineEntry:
    name: str
    factory: EngineFactory
    capabilities: EngineCapabilities
    check: ConfigCheck | None = None
    """The engine's own config rules, run when the job's config is loaded (before any process group)."""


ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, factory: EngineFactory, *, capabilities: EngineCapabilities,
                    check: ConfigCheck | None = None) -> None:
    """Make ``rollout.engine=<name>`` start with ``factory``; ValueError for a name taken."""
    if name in ENGINES:
        raise ValueError(f"rollout engine {name!r} is already registered; pick another name "
                         f"(registered: {known_engines()})")
    ENGINES[name] = EngineEntry(name, factory, capabilities, check)


def known_engines() -> list[str]:
    return sorted(ENGINES)


def engine_entry(rollout: Any) -> EngineEntry:
    """The registration of ``rollout.engine`` (after importing ``rollout.engine_module``, which may add it);
    ConfigError listing the registered names otherwise."""
    if rollout.engine_module:
        load_engine_module(rollout.engine_module)
    entry = ENGINES.get(rollout.engine)
    if entry is None:
        hint = "" if rollout.engine_module else (" (an engine of your own: rollout.engine_module=<file.py> that calls "
                                                  "megatron_rl.inference.registry.register_engine)")
        raise ConfigError(f"rollout.engine={rollout.engine!r} is not one of the registered engines "
                          f"{known_engines()}{hint}")
    return entry


def load_engine_module(where: str) -> None:
    """Import ``where`` (``path/to/file.py`` or ``package.module``) once per process; ConfigError naming
    ``rollout.engine_module`` when it cannot be imported."""
    from megatron_rl.environments.user_code import load_module

    load_module(where, "rollout.engine_module")


def check_engine_config(rollout: Any, model: Any, device: str) -> None:
    """The ``rollout`` section's rules that depend on the engine: its name is registered, the keys it sets are
    ones the engine uses (by its capabilities), then the engine's own check. ConfigError naming the key."""
    entry = engine_entry(rollout)
    capabilities, name = entry.capabilities, rollout.engine
    if rollout.partial_rollouts and (not capabilities.partial_rollouts or rollout.max_staleness < 1):
        able = [n for n, e in sorted(ENGINES.items()) if e.capabilities.partial_rollouts]
        raise ConfigError(f"rollout.partial_rollouts=true pauses the engine's generation ahead at a weight sync, "
                          f"but rollout.engine={name} and rollout.max_staleness={rollout.max_staleness}; set "
                          f"rollout.engine to one of {able} and rollout.max_staleness >= 1, or unset "
                          "rollout.partial_rollouts")
    if not capabilities.own_weights and rollout.weight_transport == "disk" and rollout.sync_dir is not None:
        able = [n for n, e in sorted(ENGINES.items()) if e.capabilities.own_weights]
        raise ConfigError(f"rollout.sync_dir is set but rollout.engine={name} syncs no weights; "
                          f"set rollout.engine to one of {able} or unset rollout.sync_dir")
    if rollout.engine_nodes and not capabilities.own_nodes:
        able = [n for n, e in sorted(ENGINES.items()) if e.capabilities.own_nodes]
        raise ConfigError(f"rollout.engine_nodes={rollout.engine_nodes} puts the engines on nodes of their own, but "
                          f"rollout.engine={name} samples on the trainer's ranks; set rollout.engine to one of "
                          f"{able} or rollout.engine_nodes=0")
    if entry.check is not None:
        entry.check(rollout, model, device)


def start_engine(config: Any, policy: Any, *, pad_token_id: int) -> RolloutEngine:
    """The engine ``config.rollout.engine`` names, started on ``policy``'s weights (collective)."""
    entry = engine_entry(config.rollout)
    engine = entry.factory(config, policy, pad_token_id=pad_token_id)
    if engine.capabilities != entry.capabilities:
        raise EngineStartError(f"rollout.engine={entry.name}: the engine's capabilities {engine.capabilities} "
                               f"differ from its registration's {entry.capabilities}")
    return engine


# ------------------------------------------------------------------------------------------- the shipped engines
def _start_builtin(config: Any, policy: Any, *, pad_token_id: int) -> RolloutEngine:
    from megatron_rl.inference.builtin_engine import BuiltinEngine

    return BuiltinEngine.from_policy(policy, pad_token_id)


def _start_vllm(config: Any, policy: Any, *, pad_token_id: int) -> RolloutEngine:
    from megatron_rl.inference.vllm.engine import start_fleet

    return start_fleet(config, policy)


def _check_vllm(rollout: Any, model: Any, device: str) -> None:
    from megatron_rl.inference.config import check_vllm_model

    if rollout.num_engines + len(rollout.engine_urls) < 1:
        raise ConfigError("rollout.num_engines=0 and no rollout.engine_urls: the vLLM fleet has no engine; set "
                          "rollout.num_engines >= 1 or list servers in rollout.engine_urls")
    check_vllm_model(rollout, model, device)


register_engine("builtin", _start_builtin, capabilities=EngineCapabilities())  # the live policy, its own groups
register_engine("vllm", _start_vllm, capabilities=VLLM_CAPABILITIES, check=_check_vllm)
