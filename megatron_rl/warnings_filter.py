"""Known fallback warnings of megatron-core 0.16.1 and mbridge 0.15.1, shown as one line instead of eight.

Place in the data flow: none; installed once at package import (``megatron_rl/__init__.py``), before any
megatron-core module is imported (most of these warnings fire at import time).

Without TransformerEngine and Apex (every CPU run, and GPU runs with ``model.attention_backend='local'``)
megatron-core and mbridge warn from eight places that they use their torch fallbacks, and megatron-core warns
about its own default ``cuda_graph_scope="full"``. None of this is actionable for a megatron_rl user, so a
warning whose category and *exact* text is listed in ``KNOWN_FALLBACK_WARNINGS`` is replaced by one line on
rank 0 the first time one fires. Every other warning (including other texts from the same modules) passes
through untouched. ``MEGATRON_RL_DEBUG=1`` shows them all, unfiltered.

Warnings that megatron-core's own calls into torch raise (``MEGATRON_CORE_CALL_WARNINGS``: a resume printed
eight, and a train step one per row-parallel layer where deprecation warnings are shown) are dropped without a
summary line: no argument of megatron_rl reaches those calls, so no user and no megatron_rl change can act on
them (docs/MEGATRON_CORE.md W17 names each call site and its removal condition).

Implementation: a wrapper around ``warnings.showwarning`` (the one hook Python calls for a warning that its
filters let through); the filters, and anything that records warnings (``catch_warnings(record=True)``,
pytest), keep working as before.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, TextIO

KNOWN_FALLBACK_WARNINGS: frozenset[str] = frozenset({
    "Transformer Engine and Apex are not installed. Falling back to local implementations of "
    "multi_tensor_applier and multi_tensor_scale",
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Transformer Engine and Apex are not installed. Falling back to local implementations of "
    "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
    "Apex is not installed. Falling back to Torch Norm",
    "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
    # megatron-core 0.19.2 (docs/MEGATRON_CORE.md W13): its own defaults, not actionable by a megatron_rl user
    "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
    "MimoModelConfig is experimental and still under active development. The API may change without notice "
    "in future releases.",
})  # fmt: skip
"""Exact texts (UserWarning) of megatron-core 0.16.1 / 0.19.2 and mbridge 0.15.1 fallback warnings."""

KNOWN_LOG_PREFIXES: tuple[str, ...] = (
    "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes",
    "MCore's async save is deprecated and will be removed in the future releases.",
)
"""Start of megatron-core 0.19.2 log records (``logging.WARNING``) about its own defaults: GPTModel is what
megatron_rl builds (HybridModel migration: docs/MEGATRON_CORE.md), and we never ask for async saves. Dropped
unless ``MEGATRON_RL_DEBUG=1``; removal condition: megatron_rl moves to HybridModel / the log goes away."""

MEGATRON_CORE_CALL_WARNINGS: frozenset[tuple[type[Warning], str]] = frozenset({
    # dist_checkpointing.load -> load_common_state_dict and TorchDistLoadShardedStrategy.load (0.19.2) call
    # torch.distributed.checkpoint.load(..., no_dist=True), the latter with the reader positional
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in "
                  "a single process."),
    (UserWarning, "The argument order of load has been changed. Please check the document to avoid future "
                  "breakages."),
    # 0.16.1's TorchDistLoadShardedStrategy.load calls the deprecated checkpoint.load_state_dict
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead."),
    # both: mcore_to_pyt_state_dict hands torch DCP legacy ShardedTensors
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    # both: RowParallelLinear.forward passes tp_group=None literally (it holds the right self.tp_group)
    (DeprecationWarning, "Warning: tp_group is None, using default tp group. Passing tp_group will be mandatory "
                         "soon"),
})  # fmt: skip
"""(category, exact text) of warnings raised inside megatron-core 0.16.1 / 0.19.2's own calls (W17): dropped."""

CPU_LOG_PREFIXES: tuple[str, ...] = ("No CUDA runtime is found, using CUDA_HOME=",)
"""Start of a ``torch.utils.cpp_extension`` log record (``logging.WARNING``) that torch 2.13 emits at import on a
machine with ``CUDA_HOME`` set but no CUDA runtime (megatron-core's ``nccl_allocator`` imports it in every rank,
and the MoE pre-flight once): nothing a CPU run can act on. Only this text of that logger is dropped, unless
``MEGATRON_RL_DEBUG=1``; removal condition: torch stops logging it at import."""

CPU_ONLY_WARNINGS: frozenset[str] = frozenset({
    "When using async grad allreduce it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
})
"""Exact texts hidden only without CUDA, where they cannot apply (megatron-core's TP layers, each process)."""

SUMMARY = (
    "megatron_rl: megatron-core/mbridge run without TransformerEngine/Apex (torch fallbacks); their "
    "fallback warnings are hidden, MEGATRON_RL_DEBUG=1 shows them"
)
"""The one line printed (rank 0, stderr) instead of the known warnings."""

_state = {"installed": False, "summarized": False}


def is_known_fallback(message: Warning | str, category: type[Warning]) -> bool:
    """True for a ``UserWarning`` whose text is exactly one of ``KNOWN_FALLBACK_WARNINGS`` (or, without CUDA,
    ``CPU_ONLY_WARNINGS``)."""
    if not issubclass(category, UserWarning):
        return False
    text = str(message)
    if text in KNOWN_FALLBACK_WARNINGS:
        return True
    import torch  # already imported by whoever emitted a megatron-core warning

    return text in CPU_ONLY_WARNINGS and not torch.cuda.is_available()


class _KnownLogFilter(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _rank() -> int:
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else 0


def install() -> None:
    """Route known fallback warnings to one summary line (idempotent; nothing with ``MEGATRON_RL_DEBUG=1``)."""
    if _state["installed"] or os.environ.get("MEGATRON_RL_DEBUG", "") not in ("", "0"):
        return
    _state["installed"] = True
    previous = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> Any:
        if (category, str(message)) in MEGATRON_CORE_CALL_WARNINGS:
            return None
        if not is_known_fallback(message, category):
            return previous(message, category, filename, lineno, file, line)
        if not _state["summarized"]:
            _state["summarized"] = True
            if _rank() == 0:
                print(SUMMARY, file=file or sys.stderr, flush=True)
        return None

    warnings.showwarning = showwarning
    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch"):
        logging.getLogger(name).addFilter(_KnownLogFilter(KNOWN_LOG_PREFIXES))  # the emitting loggers: filters
        # do not inherit
    logging.getLogger("torch.utils.cpp_extension").addFilter(_KnownLogFilter(CPU_LOG_PREFIXES))
