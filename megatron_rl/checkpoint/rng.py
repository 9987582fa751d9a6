"""Random-number-generator state of one rank, for exact resume (docs/CHECKPOINTS.md section 4).

Place in the data flow: saved per rank next to the distributed checkpoint by ``checkpoint/dist.py`` and
restored on resume when the parallel layout is unchanged (a state belongs to one rank's position in the
TP x PP x DP grid; under another layout there is no meaningful mapping, so the loader keeps the fresh seeds).

Covered: Python ``random``, NumPy's global generator, torch's CPU generator, every CUDA generator when CUDA is
available, and megatron-core's model-parallel RNG tracker (dropout inside TP regions).

Device independence (docs/DESIGN.md section 11): every state is a host tensor or a Python object, so the file
loads anywhere. What exists is restored: CUDA generators only where CUDA is (as many as both sides have), the
tracker only on the kind of device it was saved on (its states are CUDA generator states on CUDA and CPU
generator states under the CPU patches; they do not convert), else the tracker keeps its fresh seeds.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Every generator state this process draws from (picklable)."""
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": {k: v.cpu().clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        "tracker_device": _tracker_device(),
    }


def _tracker_device() -> str:
    """The kind of generator the model-parallel tracker holds here (CPU ones under the CPU patches)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    if state.get("tracker_device", "cpu") == _tracker_device():  # files without the key predate CUDA runs
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
