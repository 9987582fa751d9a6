"""Random-number-generator state of one rank, for exact resume (docs/CHECKPOINTS.md section 4).

Place in the data flow: saved per rank next to the distributed checkpoint by ``checkpoint/dist.py`` and
restored on resume when the parallel layout is unchanged (a state belongs to one rank's position in the
TP x PP x DP grid; under another layout there is no meaningful mapping, so the loader keeps the fresh seeds).

Covered: Python ``random``, NumPy's global generator, torch's CPU generator, every CUDA generator when CUDA is
available, and megatron-core's model-parallel RNG tracker (dropout inside TP regions).
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
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
