"""A teacher that sleeps in host memory between scoring passes (``distillation.teachers[i].offload: true``).

Place in the data flow: set-up wraps an in-trainer teacher (``distillation/teachers.py``); ``Distillation.score``
calls its ``forward`` once per step, and only there are its weights on the device:

    build:  MegatronPolicy(role='reference') -> every parameter copied once to (pinned) host memory, the device
            copy dropped                                            (the teacher's device memory: ~0 between passes)
    score:  wake (host -> device, one copy per parameter) -> the teacher's forward -> sleep (drop the device copy)

A frozen teacher's weights never change, so sleeping copies nothing back: the host copy is the weights. What it
costs per step is one host-to-device copy of the teacher (on a GPU, at PCIe/NVLink-C2C speed: a 8B bf16 teacher is
16 GB, ~0.3-1 s) against holding it resident beside the policy's weights, gradients and optimizer state.
On a CPU device (``parallel.device: cpu``) host and device are the same memory: the wrapper runs the same path and
moves nothing (the setting is accepted, and said once, so a config runs unchanged on both).

Only parameters move; buffers (RoPE tables, a few KB) stay. Megatron's modules read their weights through the
``Parameter`` objects, whose ``.data`` is swapped: no module keeps a second reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class OffloadedTeacher:
    """``teacher`` (a ``MegatronPolicy`` with ``model`` and ``groups``) whose parameters live on the host between
    calls of ``forward``; every other attribute is the teacher's."""

    def __init__(self, teacher: Any) -> None:
        self.teacher = teacher
        self.device = torch.device(teacher.groups.device)
        unique = {id(p): p for module in _modules(teacher.model) for p in module.parameters()}  # tied: once
        self.params = list(unique.values())
        pin = self.device.type == "cuda"
        self.host = [p.data.to("cpu", copy=True).pin_memory() if pin else p.data for p in self.params]
        self.sleep()

    def sleep(self) -> None:
        """Drop the device copies (their memory returns to the allocator)."""
        for param, host in zip(self.params, self.host):
            param.data = host
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Copy the weights back to the device."""
        for param, host in zip(self.params, self.host):
            param.data = host.to(self.device, non_blocking=True)

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The weights on the device inside the block (and asleep after it, even when it raises)."""
        self.wake()
        try:
            yield
        finally:
            self.sleep()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.awake():
            return self.teacher.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.teacher, name)


def _modules(model: Any) -> list[torch.nn.Module]:
    """The model chunks (a module or a list of them: virtual pipeline stages)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]
