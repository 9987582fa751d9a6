"""P6: megatron-core's model-parallel RNG tracker on CPU.

``model_parallel_cuda_manual_seed`` registers named RNG states (data-parallel, model-parallel = seed + 2718 +
tp_rank, expert) in ``CudaRNGStatesTracker``, and layers draw dropout / GPU-style init inside
``get_cuda_rng_tracker().fork(name)``. In megatron-core those states are CUDA generator states
(``tensor_parallel/random.py``: 0.16.1 lines 217-277, 0.19.2 lines 285-345). Here they become CPU generator
states with the same meaning: ``add`` seeds a private generator, ``fork`` swaps the CPU default generator to
the named state and back, so TP ranks draw different dropout masks in model-parallel regions exactly as on
GPU. The module-level state helpers used by activation recomputation read and write the CPU generator likewise.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.tensor_parallel import random as mcore_random

from megatron_rl import patches


def _add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add with a CPU generator state (same checks and flag as megatron-core)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def _fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
    """CudaRNGStatesTracker.fork on the CPU default generator; nested forks restore in order."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state, outer_name = torch.get_rng_state(), self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


def _get_state(device: object = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _apply() -> None:
    mcore_random.CudaRNGStatesTracker.add = _add
    mcore_random.CudaRNGStatesTracker.fork = _fork
    mcore_random._get_cuda_rng_state = _get_state
    mcore_random._set_cuda_rng_state = _set_state


PATCHES = [
    patches.Patch(
        name="P6 CPU RNG tracker",
        versions=("0.16.1", "0.19.2"),
        reason=(
            "CudaRNGStatesTracker.add/fork and _get/_set_cuda_rng_state call torch.cuda RNG APIs "
            "(tensor_parallel/random.py: 0.16.1 :41-110,217-277; 0.19.2 :104-173,285-345), "
            "needed by model_parallel_cuda_manual_seed and fork()"
        ),
        removal="megatron-core's tracker supports a CPU generator (or a device-agnostic torch RNG API)",
        apply=_apply,
    ),
]
