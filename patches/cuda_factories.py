"""P1: megatron-core modules that allocate with ``device="cuda"`` see a ``torch`` whose factories allocate on CPU.

Each module listed in ``MODULES`` (per measured version; docs/MEGATRON_CORE.md has the lines) binds the name
``torch`` at import. Its binding is replaced by ``CpuFactoryTorch``: the real ``torch`` for every attribute
except the tensor factories, which turn a CUDA ``device=`` keyword into CPU. Nothing outside those modules is
touched, so no other call pays anything (the ``TorchFunctionMode`` this replaces saw every torch call of the main
thread: ~40 % of a tiny step's Python time, issue 53). A no-op translation: no numerics change.

A call site in a module not listed fails loudly on a CPU-only torch ("Torch not compiled with CUDA enabled"):
add the module here (the suite's multi-rank tests cover the optimizer, clipping, every schedule and the
checkpoint exchange).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import types

import torch

from megatron_rl import patches

_CPU = torch.device("cpu")
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like",
)  # fmt: skip
_COMMON = (
    "megatron.core.optimizer.optimizer",  # found_inf, _dummy_overflow_buf, _scale_one, FP32Optimizer._scale
    "megatron.core.optimizer.clip_grads",  # total norm and overflow buffers
    "megatron.core.optimizer.grad_scaler",  # fp16 loss scale
    "megatron.core.utils",  # the l2 norm of get_..._norm (utils.py:1207 in 0.16.1, :1332 in 0.19.2)
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens of every schedule
    "megatron.core.rerun_state_machine",  # _reduce_any: all-reduce of a flag
    "megatron.core.dist_checkpointing.exchange_utils",  # fully parallel load: receive buffers
    "megatron.core.dist_checkpointing.mapping",  # ShardedTensor.init_data("cuda") from exchange_utils
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # the cached-plan flag
    "megatron.core.transformer.utils",  # the default causal masks of megatron's local attention
)
MODULES: dict[str, tuple[str, ...]] = {
    "0.16.1": (*_COMMON, "megatron.core.transformer.moe.moe_utils"),  # the MoE aux-loss tracker (moe_utils.py:998)
    "0.19.2": (*_COMMON, "megatron.core.optimizer.layer_wise_optimizer"),
}
"""megatron-core version -> the modules whose ``torch`` becomes ``CpuFactoryTorch``."""


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(factory):
    @functools.wraps(factory)
    def on_cpu(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return on_cpu


class CpuFactoryTorch(types.ModuleType):
    """``torch`` for one megatron-core module on CPU: factories place ``device="cuda"`` on CPU; every other
    attribute is the real torch's (looked up on each access, so later replacements are seen)."""

    def __init__(self) -> None:
        super().__init__("torch", "torch as megatron_rl.patches.cuda_factories gives it to a megatron-core module")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str):
        return getattr(torch, name)


_CPU_TORCH = CpuFactoryTorch()


def modules_for(installed: str) -> tuple[str, ...]:
    """The modules P1 rebinds on ``installed`` (every measured module on an untested version: see patches doc)."""
    if installed in MODULES:
        return MODULES[installed]
    return tuple(dict.fromkeys(name for names in MODULES.values() for name in names))


def _rebind_torch() -> None:
    for name in modules_for(importlib.metadata.version(patches.TARGET_PACKAGE)):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue  # an untested version without this module
        bound = getattr(module, "torch", None)
        if bound is not torch and bound is not _CPU_TORCH:
            raise RuntimeError(f"P1: {name} does not bind `torch` (found {bound!r}); its CUDA call sites moved: "
                               "re-measure them (docs/MEGATRON_CORE.md) and update patches/cuda_factories.py")
        module.torch = _CPU_TORCH


PATCHES = [
    patches.Patch(
        name="P1 device='cuda' in megatron-core factories",
        versions=tuple(MODULES),
        reason=(
            "device='cuda' in tensor factories: optimizer.py (found_inf, _scale_one, _scale), clip_grads.py, "
            "grad_scaler.py, utils.py (l2 norm), schedules.py (total_num_tokens), rerun_state_machine.py, "
            "dist_checkpointing exchange_utils.py / mapping.py / state_dict_saver.py; those modules' `torch` "
            "becomes CpuFactoryTorch"
        ),
        removal="megatron-core allocates on its inputs' device or a configurable one",
        apply=_rebind_torch,
    ),
]
