"""P1-P5, P9: megatron-core call sites that name the CUDA device (docs/MEGATRON_CORE.md has the lines).

P1, P4 and P5 go through one ``TorchFunctionMode`` (torch routes factory functions and Tensor methods
through it): a ``device`` keyword naming CUDA becomes CPU, ``Tensor.cuda()`` returns the tensor itself, and
``Tensor.type()`` reports the CUDA type name that megatron-core asserts on. P2 and P3 replace two
``torch.cuda`` attributes, and P9 a third: ``torch.cuda.current_stream`` returns a stream stand-in
whose waits do nothing. Everything here is a no-op translation: no numerics change.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl import patches

_MEASURED_ON = ("0.16.1", "0.19.2")
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


class _DoneEvent:
    """An event that has already happened (CPU work is synchronous)."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: object = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class NoOpStream:
    """What ``torch.cuda.current_stream()`` returns on CPU (P9), and the MoE dispatcher's side stream (P10):
    CPU work is synchronous, so every wait is done."""

    def wait_event(self, event: object) -> None:
        """Nothing to wait for (events are recorded by CUDA graph replays, which do not exist on CPU)."""

    def wait_stream(self, stream: object) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """All work is complete."""
        return True

    def record_event(self, event: object = None) -> _DoneEvent:
        """An event that is already complete."""
        return _DoneEvent()


_NO_OP_STREAM = NoOpStream()


def _current_stream(device: object = None) -> NoOpStream:
    return _NO_OP_STREAM


def _replace_current_stream() -> None:
    torch.cuda.current_stream = _current_stream


def _replace_current_device() -> None:
    torch.cuda.current_device = _current_device


def _replace_synchronize() -> None:
    torch.cuda.synchronize = _synchronize


PATCHES = [
    patches.Patch(
        name="P1/P4/P5 CpuForCudaMode",
        versions=_MEASURED_ON,
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
        versions=_MEASURED_ON,
        reason=(
            "device=torch.cuda.current_device() in DDP buffers, PP receive buffers, RoPE, SP all-gather "
            "and reduce-scatter buffers, local attention"
        ),
        removal="megatron-core takes the device from its inputs or a config field",
        apply=_replace_current_device,
    ),
    patches.Patch(
        name="P3 torch.cuda.synchronize",
        versions=_MEASURED_ON,
        reason="torch.cuda.synchronize() after batched p2p ops (p2p_communication.py:398)",
        removal="megatron-core drops the synchronize or guards it by device type",
        apply=_replace_synchronize,
    ),
    patches.Patch(
        name="P9 torch.cuda.current_stream",
        versions=_MEASURED_ON,
        reason=(
            "torch.cuda.current_stream().wait_event(...) before every DDP grad reduction "
            "(distributed/param_and_grad_buffer.py:632 in 0.19.2, start_grad_sync; also :691 and :814, "
            "only with num_distributed_optimizer_instances > 1); the MoE alltoall dispatcher compares "
            "torch.cuda.current_stream() with its side stream (token_dispatcher.py:922 in 0.19.2, :871 in 0.16.1)"
        ),
        removal="megatron-core guards the CUDA-graph event wait by device type (or only waits when an event exists)",
        apply=_replace_current_stream,
    ),
]
