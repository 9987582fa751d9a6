"""RMSNorm for the local (non-TransformerEngine) layer spec, usable with sequence parallelism (P7).

megatron-core 0.16.1's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``
(``transformer/torch_norm.py:32``). Under sequence parallelism each TP rank normalizes a different slice of
the sequence, so norm-weight gradients are partial sums that ``finalize_model_grads`` must all-reduce over
TP; it does so for params tagged ``.sequence_parallel = True`` (``distributed/finalize_model_grads.py:354``),
which is what TransformerEngine's norm does too. This module is the same math as Hugging Face's Llama RMSNorm
(normalize in fp32, cast back, then scale), and is used for the layer norms, the q/k norms and the final norm.

Kernels by device: on CUDA the normalization is ``torch.nn.functional.rms_norm`` (one fused kernel that
computes in fp32 and returns x's dtype; ~5x faster than the elementwise chain on an H100, docs/DESIGN.md section 12),
followed by the same ``weight *`` in the same order, so the rounding points are HF's; on CPU the explicit
chain stays (bitwise what the CPU parity tests pin).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


# Workaround W4 (docs/MEGATRON_CORE.md; 0.16.1, 0.19.2): remove when megatron's torch norm supports sequence parallelism.
class RMSNorm(torch.nn.Module):
    """``y = weight * (x / sqrt(mean(x**2, -1) + eps))`` over the last dim; x ``[..., hidden_size]``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused: object):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm used with normalization={config.normalization!r}; set it to 'RMSNorm'")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel for the normalization (fp32 inside, output in x's dtype), then the scale
            return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype)
