"""P1-P5: megatron-core 0.16.1 call sites that name the CUDA device (see MEGATRON_CPU_NOTES.md for lines).

P1, P4 and P5 go through one ``TorchFunctionMode`` (torch routes factory functions and Tensor methods
through it): a ``device`` keyword naming CUDA becomes CPU, ``Tensor.cuda()`` returns the tensor itself, and
``Tensor.type()`` reports the CUDA type name that megatron-core asserts on. P2 and P3 replace two
``torch.cuda`` attributes. Everything here is a no-op translation: no numerics change.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl import patches

_TARGET = f"{patches.TARGET_PACKAGE}=={patches.TARGET_VERSION}"
_CPU = torch.device("cpu")


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cuda_type_name(cpu_name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (what Tensor.type() says for a CUDA tensor)."""
    assert cpu_name.startswith("torch."), cpu_name
    return "torch.cuda." + cpu_name[len("torch.") :]


class CpuForCudaMode(TorchFunctionMode):
    """Runs code written for CUDA tensors on CPU tensors (P1, P4, P5)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # P4: weight.data.cuda() in language_module.py
            return args[0]
        if func is torch.Tensor.type:  # P5: assert grad.type() == 'torch.cuda.FloatTensor'
            return _tensor_type(func, args, kwargs)
        if _is_cuda(kwargs.get("device")):  # P1: torch.zeros(..., device="cuda")
            kwargs = dict(kwargs, device=_CPU)
        return func(*args, **kwargs)


def _tensor_type(func, args: tuple, kwargs: dict):
    if len(args) == 1 and not kwargs:
        return _cuda_type_name(func(*args))
    if len(args) == 2 and isinstance(args[1], str) and args[1].startswith("torch.cuda."):
        args = (args[0], "torch." + args[1][len("torch.cuda.") :])
    return func(*args, **kwargs)


_MODE: CpuForCudaMode | None = None


def _enter_mode() -> None:
    global _MODE
    assert _MODE is None, "CpuForCudaMode entered twice"
    _MODE = CpuForCudaMode()
    _MODE.__enter__()  # never exited: the mode lives as long as the process (the thread, see patches doc)


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device: object = None) -> None:
    """Nothing to wait for: CPU ops are synchronous."""


def _replace_current_device() -> None:
    torch.cuda.current_device = _current_device


def _replace_synchronize() -> None:
    torch.cuda.synchronize = _synchronize


PATCHES = [
    patches.Patch(
        name="P1/P4/P5 CpuForCudaMode",
        target=_TARGET,
        reason=(
            "device='cuda' in tensor factories (optimizer.py, clip_grads.py, utils.py, schedules.py), "
            "Tensor.cuda() (language_module.py:244), Tensor.type() == 'torch.cuda.FloatTensor' "
            "(clip_grads.py:167, distrib_optimizer.py)"
        ),
        removal="megatron-core allocates on the device of its inputs / a configurable device",
        apply=_enter_mode,
    ),
    patches.Patch(
        name="P2 torch.cuda.current_device",
        target=_TARGET,
        reason=(
            "device=torch.cuda.current_device() in DDP buffers, PP receive buffers, RoPE, SP all-gather "
            "and reduce-scatter buffers, local attention"
        ),
        removal="megatron-core takes the device from its inputs or a config field",
        apply=_replace_current_device,
    ),
    patches.Patch(
        name="P3 torch.cuda.synchronize",
        target=_TARGET,
        reason="torch.cuda.synchronize() after batched p2p ops (p2p_communication.py:398)",
        removal="megatron-core drops the synchronize or guards it by device type",
        apply=_replace_synchronize,
    ),
]
