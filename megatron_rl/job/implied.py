"""Settings that have one valid value given the others: derived, and said, instead of asked for.

Place in the data flow: between reading the config (YAML layers + overrides, flat dotted keys:
``megatron_rl/config_files.py``) and building it (``job/config.py: load_job_config``, on every rank and in the
pre-flight), and in the launch's first line (``job/paths.py: main``), which names what was implied. Stdlib only:
the first line must stay fast.

The rules (a key is implied only where the config leaves it unset; a value set against the rule is the one real
conflict, refused by ``job/config.py`` with one line):

- a step-API environment (``job.environment=<file.py>:<Class>``) or an agent (``job.agent``) trains step-wise,
  one step per turn or call: ``stepwise.step_wise_trajectories=true`` (false is refused), and merges the steps
  whose prompts extend each other into one sequence: ``stepwise.merge_stepwise_output=true`` (false is kept:
  every turn is then its own sequence);
- an agent's calls are sampled on the vLLM fleet: ``rollout.engine=vllm`` (builtin is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Implied:
    key: str
    value: Any
    because: str
    """The setting that implies it, e.g. ``job.agent is set``."""


def task_kind(flat: Mapping[str, Any]) -> str | None:
    """Why the task implies settings: ``'job.agent is set'``, ``'job.environment is a step-API class'``, or None."""
    if flat.get("job.agent"):
        return "job.agent is set"
    environment = flat.get("job.environment")
    if isinstance(environment, str) and ":" in environment:  # registry.py: is_class_spec
        return "job.environment is a step-API class"
    return None


def implied_settings(flat: Mapping[str, Any]) -> list[Implied]:
    """The settings ``flat`` (dotted key -> raw value) leaves unset that its task allows one value for."""
    because = task_kind(flat)
    if because is None:
        return []
    rules: list[tuple[str, Any]] = [("stepwise.step_wise_trajectories", True)]
    if flat.get("stepwise.step_wise_trajectories", True) is not False:  # else job/config.py refuses the false
        rules.append(("stepwise.merge_stepwise_output", True))
    if flat.get("job.agent"):
        rules.append(("rollout.engine", "vllm"))
    return [Implied(key, value, because) for key, value in rules if key not in flat]


def with_implied(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` with its implied settings added."""
    return {**flat, **{item.key: item.value for item in implied_settings(flat)}}


def describe(implied: list[Implied]) -> str:
    """``implied by <why>: key=value, ...`` (the launch's first line), or '' when nothing is implied."""
    if not implied:
        return ""
    shown = ", ".join(f"{item.key}={str(item.value).lower() if isinstance(item.value, bool) else item.value}"
                      for item in implied)
    return f"implied ({implied[0].because}): {shown}"
