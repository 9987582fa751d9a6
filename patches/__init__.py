"""CPU adaptations of megatron-core (quarantined; docs/MEGATRON_CORE.md, docs/STYLE.md habit 13).

megatron-core hard-codes CUDA in a handful of places (call sites P1-P6 and P9 in docs/MEGATRON_CORE.md).
``megatron_rl.distributed.bootstrap.initialize_distributed`` calls ``apply_cpu_patches()`` once, before any model
is built (on a machine with CUDA it applies only the ``on_cuda`` patches, which stand in for a missing optional
package); nothing else in megatron_rl imports this package or
branches on whether a patch is applied. Each patch is a ``Patch`` record naming the megatron-core versions it
was measured on, the reason and the condition under which it can be deleted.

    P1          patches/cuda_factories.py  the listed megatron-core modules' ``torch``: factories put device="cuda"
                                       on CPU (no other call is touched: no global dispatch hook)
    P2, P3      patches/cuda_calls.py  torch.cuda.current_device -> cpu, torch.cuda.synchronize -> no-op
    P4, P5      patches/cuda_calls.py  Tensor.cuda() -> self, Tensor.type() reports "torch.cuda.*" names
    P9          patches/cuda_calls.py  torch.cuda.current_stream -> a no-op stream
    P6          patches/rng.py         the model-parallel RNG tracker keeps CPU generator states
    P10, P11    patches/moe.py         the MoE alltoall dispatcher: its side stream, split sizes on the host
    P12         patches/fla_standins.py  torch l2norm / causal_conv1d / chunk_gated_delta_rule for Gated-DeltaNet
                                       (Qwen3.5) where fla is absent, looping over packed sequences; applied on
                                       CUDA machines too (``Patch.on_cuda``: fla is optional there)

P7 (a norm that supports sequence parallelism) and P8 (THD-capable core attention) are layer-spec
substitutions made by ``megatron_rl.model.builder``, not patches.

Version policy: megatron_rl supports ``SUPPORTED_RANGE`` of megatron-core (what ``setup.py`` admits) and CI
tests both ends, ``TESTED_VERSIONS``. Each patch lists the versions it was measured on (``Patch.versions``)
and is applied on those; on a version in the range that CI does not test, every patch is applied (each is a
no-op translation where its call site is absent) and a warning says so. Outside the range
``apply_cpu_patches`` refuses with a RuntimeError naming the range (the call sites may have moved, and a
silently half-working patch is worse than none) unless ``MEGATRON_RL_ALLOW_UNTESTED_MCORE=1`` is set, which
downgrades the refusal to a warning.

Scope: the effects are process-global (``torch.cuda.current_device`` and ``Tensor.cuda`` are replaced for
everyone, in every thread), except P1, which rebinds ``torch`` in the megatron-core modules it lists only. No
patch installs a dispatch hook (a ``TorchFunctionMode``): a torch call outside the patched attributes costs
what it costs without the patches.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger("megatron_rl.patches")

TARGET_PACKAGE = "megatron-core"
SUPPORTED_RANGE = ">=0.16.1,<0.20"
"""The megatron-core versions megatron_rl supports: setup.py's install_requires admits exactly this range."""
TESTED_VERSIONS = ("0.16.1", "0.19.2")
"""The ends of the range CI runs the whole suite on (Python 3.11 and Python 3.12); see docs/MEGATRON_CORE.md."""
ALLOW_ENV = "MEGATRON_RL_ALLOW_UNTESTED_MCORE"


@dataclass(frozen=True)
class Patch:
    name: str
    """Short id, e.g. "P2 torch.cuda.current_device"."""
    versions: tuple[str, ...]
    """The megatron-core versions the patch was measured on (where it is needed), a subset of TESTED_VERSIONS."""
    reason: str
    """The CUDA assumption it removes, with megatron-core call sites."""
    removal: str
    """When the patch can be deleted."""
    apply: Callable[[], None]
    """Installs the patch; called at most once per process."""
    on_cuda: bool = False
    """Applied where CUDA is available too: it stands in for a missing optional package (P12: fla), not for a CUDA
    call, so a GPU machine without that package needs it as well."""

    @property
    def target(self) -> str:
        """``megatron-core==0.16.1,==0.19.2``: the measured versions as one requirement string."""
        return f"{TARGET_PACKAGE}" + ",".join(f"=={v}" for v in self.versions)

    def applies_to(self, installed: str) -> bool:
        """Measured on ``installed``, or ``installed`` is untested (then every patch applies, see module doc)."""
        return installed in self.versions or installed not in TESTED_VERSIONS


_APPLIED: list[str] | None = None


def registry() -> list[Patch]:
    """All CPU patches, in the order they are applied."""
    from megatron_rl.patches import cuda_calls, cuda_factories, fla_standins, moe, rng

    return [*cuda_factories.PATCHES, *cuda_calls.PATCHES, *rng.PATCHES, *moe.PATCHES, *fla_standins.PATCHES]


def in_supported_range(version: str) -> bool:
    """Whether ``version`` lies in SUPPORTED_RANGE (PEP 440 comparison)."""
    return Version(version) in SpecifierSet(SUPPORTED_RANGE)


def check_megatron_version() -> str:
    """Installed megatron-core version; RuntimeError (or a warning, see module doc) if it is out of range."""
    installed = importlib.metadata.version(TARGET_PACKAGE)
    if installed in TESTED_VERSIONS:
        return installed
    tested = " and ".join(TESTED_VERSIONS)
    if in_supported_range(installed):
        warnings.warn(
            f"{TARGET_PACKAGE} {installed} is in megatron_rl's supported range {SUPPORTED_RANGE} but CI tests "
            f"only {tested}; applying every CPU patch (docs/MEGATRON_CORE.md: adding a version)",
            stacklevel=2,
        )
        return installed
    message = (
        f"megatron_rl.patches supports {TARGET_PACKAGE}{SUPPORTED_RANGE} (tested: {tested}) but {installed} is "
        f"installed; install {TARGET_PACKAGE}=={TESTED_VERSIONS[-1]} (Python >= 3.12) or "
        f"=={TESTED_VERSIONS[0]} (Python 3.11), or re-measure the call sites (docs/MEGATRON_CORE.md) and set "
        f"{ALLOW_ENV}=1 to try anyway"
    )
    if os.environ.get(ALLOW_ENV) != "1":
        raise RuntimeError(message)
    warnings.warn(message, stacklevel=2)
    return installed


def apply_cpu_patches() -> list[str]:
    """Apply every CPU patch once per process (idempotent); returns the names applied (or already applied).

    When CUDA is available only the ``on_cuda`` patches are applied (each a no-op where its package is
    installed): the others exist only for CUDA-less machines.
    """
    global _APPLIED
    if _APPLIED is not None:
        return list(_APPLIED)
    cuda = torch.cuda.is_available()
    if cuda:
        logger.info("CUDA is available: only the patches for missing optional packages are applied")
    installed = check_megatron_version()
    applied = []
    for patch in registry():
        if not patch.applies_to(installed) or (cuda and not patch.on_cuda):
            continue
        patch.apply()
        applied.append(patch.name)
        logger.info("applied %s (target %s): %s", patch.name, patch.target, patch.reason)
    _APPLIED = applied
    return list(applied)


def applied_patches() -> list[str]:
    """Names of the patches applied in this process ([] if none)."""
    return list(_APPLIED or [])
