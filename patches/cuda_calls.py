"""P2-P5, P9: megatron-core's CUDA calls that are not tensor factories (docs/MEGATRON_CORE.md has the lines).

P2, P3 and P9 replace three ``torch.cuda`` attributes: ``current_device`` returns the CPU device,
``synchronize`` does nothing and ``current_stream`` returns a stream stand-in whose waits do nothing. P4 and P5
replace two ``Tensor`` methods, which only their callers pay for: ``Tensor.cuda()`` returns the tensor itself and
``Tensor.type()`` reports the CUDA type name that megatron-core asserts on. Factories with ``device="cuda"`` are
P1 (``patches/cuda_factories.py``). Everything here is a no-op translation: no numerics change.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl import patches

_MEASURED_ON = ("0.16.1", "0.19.2")
_CPU = torch.device("cpu")


def _cuda_type_name(cpu_name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (what Tensor.type() says for a CUDA tensor)."""
    assert cpu_name.startswith("torch."), cpu_name
    return "torch.cuda." + cpu_name[len("torch.") :]


def _tensor_itself(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``Tensor.cuda()`` on CPU (P4): the tensor stays where it is."""
    return self


def _replace_tensor_cuda() -> None:
    torch.Tensor.cuda = _tensor_itself


def _cuda_type_method(original):
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        """``Tensor.type()`` names the CUDA type (P5); ``Tensor.type("torch.cuda.X")`` converts to the CPU type."""
        if not args and not kwargs:
            return _cuda_type_name(original(self))
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("torch.cuda."):
            args = ("torch." + args[0][len("torch.cuda.") :],)
        return original(self, *args, **kwargs)

    return type_


def _replace_tensor_type() -> None:
    torch.Tensor.type = _cuda_type_method(torch.Tensor.type)


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
    patches.Patch(
        name="P4 Tensor.cuda",
        versions=_MEASURED_ON,
        reason=(
            "weight.data.cuda() syncing tied embeddings under PP (language_module.py:244 in 0.16.1, :307 in "
            "0.19.2); the distributed optimizer's checkpoint exchange (distrib_optimizer.py:1089 in 0.16.1, :1374 "
            "in 0.19.2)"
        ),
        removal="megatron-core moves tensors to the device of the model (or its inputs)",
        apply=_replace_tensor_cuda,
    ),
    patches.Patch(
        name="P5 Tensor.type",
        versions=_MEASURED_ON,
        reason=(
            "assert grad.type() == 'torch.cuda.FloatTensor' (clip_grads.py:167 in 0.16.1, :174 in 0.19.2); "
            "param.type() checks of the mixed-precision and distributed optimizers (0.16.1: optimizer.py:671,690, "
            "distrib_optimizer.py:361,420,582; 0.19.2: optimizer.py:1009,1028, distrib_optimizer.py:401,466,758)"
        ),
        removal="megatron-core's checks test the dtype, not the device",
        apply=_replace_tensor_type,
    ),
]
