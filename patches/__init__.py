"""CPU adaptations of megatron-core (quarantined; DESIGN.md section 7, STYLE.md habit 13).

megatron-core 0.16.1 hard-codes CUDA in a handful of places (call sites P1-P6 in MEGATRON_CPU_NOTES.md).
On a machine without CUDA, ``megatron_rl.distributed.bootstrap.initialize_distributed`` calls
``apply_cpu_patches()`` once, before any model is built; nothing else in megatron_rl imports this package or
branches on whether a patch is applied. Each patch is a ``Patch`` record naming its target version, the reason
and the condition under which it can be deleted.

    P1, P4, P5  patches/cuda_calls.py  one TorchFunctionMode: device="cuda" -> cpu, Tensor.cuda() -> self,
                                       Tensor.type() reports "torch.cuda.*" names
    P2, P3      patches/cuda_calls.py  torch.cuda.current_device -> cpu, torch.cuda.synchronize -> no-op
    P6          patches/rng.py         the model-parallel RNG tracker keeps CPU generator states

P7 (a norm that supports sequence parallelism) and P8 (THD-capable core attention) are layer-spec
substitutions made by ``megatron_rl.model.builder``, not patches.

Version policy: the patches are written against one megatron-core version (``TARGET_VERSION``). On another
version ``apply_cpu_patches`` refuses with a RuntimeError (the call sites may have moved, and a silently
half-working patch is worse than none) unless ``MEGATRON_RL_ALLOW_UNTESTED_MCORE=1`` is set, which downgrades
the refusal to a warning.

Scope: the effects are process-global (``torch.cuda.current_device`` is replaced for everyone), except the
TorchFunctionMode, which torch keeps per thread: it is active in the thread that called
``apply_cpu_patches`` (the main thread), not in threads started by other code.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("megatron_rl.patches")

TARGET_PACKAGE = "megatron-core"
TARGET_VERSION = "0.16.1"
ALLOW_ENV = "MEGATRON_RL_ALLOW_UNTESTED_MCORE"


@dataclass(frozen=True)
class Patch:
    name: str
    """Short id, e.g. "P2 torch.cuda.current_device"."""
    target: str
    """The package version the patch was written and measured against (``package==version``)."""
    reason: str
    """The CUDA assumption it removes, with megatron-core call sites."""
    removal: str
    """When the patch can be deleted."""
    apply: Callable[[], None]
    """Installs the patch; called at most once per process."""


_APPLIED: list[str] | None = None


def registry() -> list[Patch]:
    """All CPU patches, in the order they are applied."""
    from megatron_rl.patches import cuda_calls, rng

    return [*cuda_calls.PATCHES, *rng.PATCHES]


def check_megatron_version() -> str:
    """Installed megatron-core version; RuntimeError (or a warning, see module doc) if it is not the target."""
    installed = importlib.metadata.version(TARGET_PACKAGE)
    if installed == TARGET_VERSION:
        return installed
    message = (
        f"megatron_rl.patches targets {TARGET_PACKAGE}=={TARGET_VERSION} but {installed} is installed; "
        f"install {TARGET_PACKAGE}=={TARGET_VERSION}, or re-measure the call sites in MEGATRON_CPU_NOTES.md "
        f"and set {ALLOW_ENV}=1 to try anyway"
    )
    if os.environ.get(ALLOW_ENV) != "1":
        raise RuntimeError(message)
    warnings.warn(message, stacklevel=2)
    return installed


def apply_cpu_patches() -> list[str]:
    """Apply every CPU patch once per process (idempotent); returns the names applied (or already applied).

    Does nothing (returns []) when CUDA is available: the patches exist only for CUDA-less machines.
    """
    global _APPLIED
    if _APPLIED is not None:
        return list(_APPLIED)
    if torch.cuda.is_available():
        logger.info("CUDA is available: megatron-core CPU patches not applied")
        _APPLIED = []
        return []
    check_megatron_version()
    applied = []
    for patch in registry():
        patch.apply()
        applied.append(patch.name)
        logger.info("applied %s (target %s): %s", patch.name, patch.target, patch.reason)
    _APPLIED = applied
    return list(applied)


def applied_patches() -> list[str]:
    """Names of the patches applied in this process ([] if none)."""
    return list(_APPLIED or [])
