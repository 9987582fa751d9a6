"""Where the main job starts from: the base config it reads, and paths taken from where the user stands.

Place in the data flow: the very first step of a launch. ``run_megatron.sh`` records the caller's directory in
``$MEGATRON_RL_CALLER_CWD`` before it changes into the repository, then runs
``python -m megatron_rl.job.paths "$@"`` (stdlib and pyyaml only, ~0.06 s), which prints the base config to read; every
rank and the pre-flight load the config with ``job/config.py: load_job_config``, which resolves the path keys
with ``resolve_path_keys``.

Base config (``base_config``): ``configs/user_job.yaml`` (values for a pretrained model on a real task) when the
command names a task of the user's (``USER_TASK_KEYS``), else ``configs/demo_cpu.yaml`` (the digit game).
``$CONFIG`` (``config_layers``): a shipped config (``configs/``) is complete and read alone; a user's YAML builds
on the base the command would have picked (its own task keys count), unless it says otherwise with a top-level
``base:`` (a path, relative to the YAML's folder, or ``null``: the defaults alone). The layers are printed one
per line; the launcher passes each as ``--config`` (later ones override earlier ones).

Paths: every relative value of ``PATH_KEYS`` (and each teacher's ``hf_path`` under ``TEACHERS_KEY``, the file part
of ``path/to/file.py:name`` in ``SPEC_KEYS``, a ``path/to/file.py`` of ``MODULE_KEYS``),
from the YAML or the command line, is made absolute against the caller's directory (``caller_cwd``), so the
config a run writes holds absolute paths and the ranks (which run in the repository) find the same files.
``$CONFIG`` itself is taken from the caller's directory too; a relative one that is not there but is in the
repository (``configs/demo_gpu.yaml``) is the repository's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (``configs/`` lives here)."""
CALLER_CWD_ENV = "MEGATRON_RL_CALLER_CWD"
"""The directory the user ran ``run_megatron.sh`` from (exported by it before it changes directory)."""
DEMO_CONFIG = "configs/demo_cpu.yaml"
USER_JOB_CONFIG = "configs/user_job.yaml"
USER_TASK_KEYS = ("data.train_files", "job.environment", "job.agent")
"""Overrides that make the command a user's job (``job.environment`` unless it names the digit game)."""
DEMO_ENVIRONMENTS = ("auto", "next_digit")
PATH_KEYS = ("model.hf_path", "data.train_files", "data.val_files", "logging.output_dir", "checkpoint.save_dir",
             "export.dir", "rollout.sync_dir")
"""Keys whose values are file-system paths (a string, or a list of them)."""
TEACHERS_KEY = "distillation.teachers"
"""A list of mappings whose ``hf_path`` values are file-system paths."""
SHIPPED_CONFIGS = REPO_ROOT / "configs"
"""Complete configs: a ``$CONFIG`` here is read alone."""
BASE_KEY = "base"
"""Top-level key of a user's YAML naming what it builds on (a path, or null for the defaults alone)."""
SPEC_KEYS = ("reward.function", "job.environment", "job.agent", "model.family")
"""Keys of the form ``path/to/file.py:name`` (or ``package.module:name``, left alone)."""
MODULE_KEYS = ("rollout.engine_module",)
"""Keys of the form ``path/to/file.py`` (or ``package.module``, left alone)."""


def caller_cwd() -> Path:
    """The user's directory: ``$MEGATRON_RL_CALLER_CWD`` when a launcher set it, else this process's."""
    return Path(os.environ.get(CALLER_CWD_ENV) or os.getcwd())


def _override_value(overrides: Sequence[str], key: str) -> str | None:
    """The last ``key=value`` among ``overrides`` (raw text), or None."""
    values = [item.split("=", 1)[1] for item in overrides if item.split("=", 1)[0].strip() == key and "=" in item]
    return values[-1] if values else None


def user_task_key(overrides: Sequence[str], yaml_keys: Mapping[str, Any] | None = None) -> str | None:
    """The first key that names a task of the user's (prompt files, an environment other than the digit game, an
    agent) among ``overrides`` and a user's YAML (``yaml_keys``: its flat keys), or None."""
    for key in USER_TASK_KEYS:
        value = _override_value(overrides, key)
        if value is None and yaml_keys is not None and yaml_keys.get(key) is not None:
            value = str(yaml_keys[key])
        if value and not (key == "job.environment" and value.strip() in DEMO_ENVIRONMENTS):
            return key
    return None


def base_config(config: str | None, overrides: Sequence[str]) -> tuple[Path, str]:
    """``(base config file, why it was chosen)``: ``config`` (``$CONFIG``) when given, resolved with
    ``resolve_config``, else the user-job or the demo config (module docstring)."""
    if config:
        return resolve_config(config), "CONFIG"
    key = user_task_key(overrides)
    if key is not None:
        return REPO_ROOT / USER_JOB_CONFIG, f"your job: {key} is set; CONFIG=... picks another"
    return REPO_ROOT / DEMO_CONFIG, "the digit-game demo: no data.train_files; CONFIG=... picks another"


def config_layers(config: str | None, overrides: Sequence[str]) -> tuple[list[Path], str]:
    """``(the YAML files to read in order, why)``: without ``config`` the base (``base_config``); a shipped
    config alone; a user's YAML on the base the command would have picked, or on its own ``base:`` (module
    docstring). ConfigError when the user's YAML cannot be read."""
    from megatron_rl.config_files import read_overrides

    if not config:
        return [base_config(None, overrides)[0]], base_config(None, overrides)[1]
    mine = resolve_config(config)
    if mine.resolve().is_relative_to(SHIPPED_CONFIGS.resolve()) or not mine.is_file():
        return [mine], "CONFIG"
    keys = read_overrides(mine)
    if BASE_KEY in keys:
        base = keys[BASE_KEY]
        if base is None:
            return [mine], f"CONFIG; its {BASE_KEY}: null starts from the defaults"
        return [Path(absolute(str(base), mine.parent)), mine], f"CONFIG on its {BASE_KEY}: {base}"
    key = user_task_key(overrides, keys)
    base = REPO_ROOT / (USER_JOB_CONFIG if key is not None else DEMO_CONFIG)
    task = f"your job: {key} is set" if key is not None else "the digit-game demo"
    return [base, mine], (f"your CONFIG on the base your command picks, {task}; a top-level '{BASE_KEY}: null' in "
                          "it starts from the defaults instead")


def resolve_config(config: str) -> Path:
    """``$CONFIG`` against the caller's directory; a relative path found only in the repository is its file."""
    path = Path(config).expanduser()
    if path.is_absolute():
        return path
    mine = caller_cwd() / path
    return mine if mine.exists() or not (REPO_ROOT / path).exists() else REPO_ROOT / path


def absolute(value: str, base: Path) -> str:
    """``value`` made absolute against ``base`` (``~`` expanded); absolute paths unchanged."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def _resolve_spec(value: str, base: Path) -> str:
    where, sep, name = value.rpartition(":")
    return f"{absolute(where, base)}:{name}" if sep and where.endswith(".py") else value


def resolve_path_keys(flat: Mapping[str, Any], base: Path | None = None) -> dict[str, Any]:
    """``flat`` (dotted key -> raw value) with every relative path of ``PATH_KEYS``, ``SPEC_KEYS`` and
    ``MODULE_KEYS`` made absolute against ``base`` (default ``caller_cwd()``); other values untouched."""
    base = caller_cwd() if base is None else base
    out = dict(flat)
    for key in PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value:
            out[key] = absolute(value, base)
        elif isinstance(value, list):
            out[key] = [absolute(v, base) if isinstance(v, str) and v else v for v in value]
    if isinstance(out.get(TEACHERS_KEY), list):  # each teacher's hf_path (megatron_rl/distillation)
        out[TEACHERS_KEY] = [dict(t, hf_path=absolute(t["hf_path"], base))
                             if isinstance(t, dict) and isinstance(t.get("hf_path"), str) and t["hf_path"] else t
                             for t in out[TEACHERS_KEY]]
    for key in SPEC_KEYS:
        if isinstance(out.get(key), str):
            out[key] = _resolve_spec(out[key], base)
    for key in MODULE_KEYS:
        if isinstance(out.get(key), str) and out[key].endswith(".py"):
            out[key] = absolute(out[key], base)
    return out


def implied_note(layers: list[Path], overrides: Sequence[str]) -> str:
    """What the config of ``layers`` with ``overrides`` implies (``job/implied.py``), for the first line; '' when
    nothing, or when the config cannot be read (the pre-flight then names the mistake)."""
    from megatron_rl.config_files import ConfigError, read_overrides
    from megatron_rl.job.implied import describe, implied_settings

    try:
        return describe(implied_settings(read_overrides(layers, overrides)))
    except ConfigError:
        return ""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_rl.job.paths [key=value ...]`` (``$CONFIG`` from the environment): prints the config
    files to read on stdout, one per line, in order (``config_layers``), and ``base config: <path>[, then
    <path>] (<why>)[; implied (<why>): key=value, ...]`` on stderr (the launch's first line: ``job/implied.py``
    says what the task implies); exit 2 when a file does not exist or a user's YAML cannot be read."""
    from megatron_rl.config_files import ConfigError

    overrides = list(sys.argv[1:] if argv is None else argv)
    config = os.environ.get("CONFIG") or None
    try:
        layers, why = config_layers(config, overrides)
    except ConfigError as err:
        print(f"run_megatron.sh: CONFIG={config!r}: {err}", file=sys.stderr)
        return 2
    for path in layers:
        if not path.is_file():
            named = f"CONFIG={config!r}" if path == layers[-1] else f"{BASE_KEY}: {path} (in CONFIG={config!r})"
            print(f"run_megatron.sh: {named} is not a file (looked in {caller_cwd()} and the repository "
                  f"{REPO_ROOT}); give the path of a YAML config", file=sys.stderr)
            return 2
    implied = implied_note(layers, overrides)
    shown = ", then ".join(str(path) for path in layers)
    print(f"base config: {shown} ({why})" + (f"; {implied}" if implied else ""), file=sys.stderr, flush=True)
    print("\n".join(str(path) for path in layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
