"""Importing megatron-core without paying for ``torch.compile`` at import time (workaround W36).

megatron-core binds ``megatron.core.jit.jit_fuser = torch.compile`` when it is imported and decorates its fused
element-wise functions with it (``fusions/fused_bias_geglu.py`` and others, imported by ``megatron.core`` itself),
and the MoE router decorates a method with ``@torch.compile``. Applying ``torch.compile`` imports TorchDynamo and
Inductor (a few hundred modules), so every process that imports megatron-core paid ~2.8 CPU s for it (6.4 -> 3.6
CPU s for ``import megatron.core``, torch included, on the 2-core machine): every rank of every launch, whether
or not a fused function ever runs (on CPU they do not: megatron_rl turns the fusions off there). A rank that
builds an optimizer imports TorchDynamo anyway (``torch.optim``'s ``add_param_group``), so there the saving is
Inductor's part, ~1.6 CPU s.

``install()`` (called by ``megatron_rl/__init__.py``) puts a finder on ``sys.meta_path`` that runs the body of
every ``megatron.core`` module with ``torch.compile`` replaced by ``lazy_compile``: the decorated function is
compiled by the real ``torch.compile`` with the same arguments at its first call, so a fused function that does
run (on a GPU) is compiled exactly as before, only later. Outside megatron-core's module bodies ``torch.compile``
is the real one. Version: megatron-core 0.16.1 and 0.19.2 (``megatron/core/jit.py: enable_jit_fuser``). Remove
when megatron-core stops calling ``torch.compile`` at import time.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Callable

_PACKAGE = "megatron.core"
_state = {"installed": False, "depth": 0, "real": None}
_lock = threading.RLock()


def lazy_compile(model: Callable | None = None, **options: Any) -> Any:
    """``torch.compile`` deferred to the first call (as a decorator with or without arguments)."""
    if model is None:
        return lambda fn: lazy_compile(fn, **options)
    real = _state["real"]
    compiled: list[Callable] = []

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(real(model, **options))
        return compiled[0](*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """Wraps a megatron-core module's loader: its body runs with ``torch.compile`` = ``lazy_compile``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        with _lock:
            if _state["depth"] == 0:
                _state["real"] = torch.compile
                torch.compile = lazy_compile
            _state["depth"] += 1
        try:
            self.loader.exec_module(module)
        finally:
            with _lock:
                _state["depth"] -= 1
                if _state["depth"] == 0:
                    torch.compile = _state["real"]

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools that ask the loader
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _PACKAGE and not name.startswith(_PACKAGE + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent; a no-op once megatron-core is imported (its functions are decorated already)."""
    if _state["installed"] or _PACKAGE in sys.modules:
        return
    _state["installed"] = True
    sys.meta_path.insert(0, _Finder())
