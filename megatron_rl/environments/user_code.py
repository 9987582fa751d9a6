"""Find a user's object from ``path/to/file.py:name`` or ``package.module:name`` (a config value).

Place in the data flow: set-up, before any process group: ``job.environment=<file.py>:<Class>`` (``step_api/``)
and ``reward.function`` (``single_turn/reward.py``); a whole module: ``rollout.engine_module``
(``inference/registry.py``: ``load_module``). Every failure is a ``ConfigError`` naming the config key and
the spec: a malformed spec, a missing file, an import that raises, a missing name. A file is imported once per
process (every environment of one process shares the module), with its folder on ``sys.path`` (first, as
``python file.py`` would put it), so that it imports the modules beside it (``from guess_env import GuessEnv``)
in every process that loads it: the pre-flight and every rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError


def load_object(spec: str | None, key: str, what: str = "object") -> Any:
    """The object ``spec`` names; ``key`` (e.g. ``job.environment``) and ``what`` (e.g. "class") word the errors."""
    if not spec or ":" not in spec:
        raise ConfigError(f"{key}={spec!r} must look like path/to/file.py:Name or package.module:Name")
    where, name = spec.rsplit(":", 1)
    module = _load_file(where, spec, key) if where.endswith(".py") else _import_module(where, spec, key)
    if not hasattr(module, name):
        raise ConfigError(f"{key}={spec!r}: {where} has no {what} {name!r}")
    return getattr(module, name)


def load_module(where: str, key: str) -> Any:
    """The module ``where`` names (``path/to/file.py`` or ``package.module``), imported once per process;
    ConfigError naming ``key`` when it cannot be."""
    return _load_file(where, where, key) if where.endswith(".py") else _import_module(where, where, key)


def _load_file(path: str, spec: str, key: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}={spec!r}: {path!r} is not a file (paths are relative to the directory the job "
                          "starts in)")
    name = f"megatron_rl_user_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:  # loaded before
        return sys.modules[name]
    folder = str(file.resolve().parent)
    if folder not in sys.path:  # its sibling modules import as they would for `python file.py`
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"{key}={spec!r}: importing {path} raised {type(err).__name__}: {err}") from err
    return module


def _import_module(module: str, spec: str, key: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{key}={spec!r}: cannot import {module!r} ({err}); give a file path "
                          "(path/to/file.py:Name) or a module on PYTHONPATH") from err
    except Exception as err:
        raise ConfigError(f"{key}={spec!r}: importing {module} raised {type(err).__name__}: {err}") from err
