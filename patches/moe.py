"""P10, P11: megatron-core's MoE token dispatcher on CPU/gloo (docs/MEGATRON_CORE.md; docs/MOE.md section 2).

The alltoall dispatcher (``transformer/moe/token_dispatcher.py``) copies its split sizes to the host on a side
CUDA stream and hands them to ``all_to_all_single``. On CPU two things break, both no-op translations here:

    P10  ``MoEAlltoAllTokenDispatcher.__init__`` creates the class-wide ``torch.cuda.Stream()`` (raises without
         a CUDA driver, even at EP=1): the class attribute is set beforehand to a stream stand-in whose
         ``record_event()`` returns an event that is already complete (CPU work is synchronous).
    P11  ``moe_utils.maybe_move_tensor_to_cpu`` converts CUDA tensors only, so on CPU the split sizes stay
         tensors and gloo's ``all_to_all_single`` rejects them ("incompatible function arguments"): the
         replacement also converts CPU tensors when ``as_numpy=True`` (what the CUDA path returns). The
         dispatcher imported the function by name, so both module attributes are replaced.

``torch.cuda.current_stream`` (used beside P10) is P9; ``torch.cuda.stream(...)`` is a no-op context on CPU.
"""

from __future__ import annotations

import torch

from megatron_rl import patches
from megatron_rl.patches.cuda_calls import NoOpStream

_MEASURED_ON = ("0.16.1", "0.19.2")


def _stand_in_dtoh_stream() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = NoOpStream()


def _move_tensor_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``maybe_move_tensor_to_cpu`` for CPU tensors too: numpy when asked (record_stream has no CPU meaning)."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _replace_move_to_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _move_tensor_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _move_tensor_to_host


PATCHES = [
    patches.Patch(
        name="P10 MoE dispatcher side stream",
        versions=_MEASURED_ON,
        reason=(
            "MoEAlltoAllTokenDispatcher.__init__ creates torch.cuda.Stream() for its device-to-host copies "
            "(token_dispatcher.py:469 in 0.19.2, :445 in 0.16.1)"
        ),
        removal="megatron-core creates the side stream only on CUDA (or lazily, when a CUDA tensor is dispatched)",
        apply=_stand_in_dtoh_stream,
    ),
    patches.Patch(
        name="P11 MoE split sizes on the host",
        versions=_MEASURED_ON,
        reason=(
            "maybe_move_tensor_to_cpu (moe_utils.py:1184 in 0.19.2, :1093 in 0.16.1) leaves CPU tensors as "
            "tensors; gloo's all_to_all_single needs the split sizes as a host sequence"
        ),
        removal="megatron-core converts split sizes for every device (or torch's gloo accepts tensor splits)",
        apply=_replace_move_to_cpu,
    ),
]
