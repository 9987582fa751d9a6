"""Hybrid Gated-DeltaNet models (Qwen3.5): megatron-core's ``GatedDeltaNet`` layers among full-attention layers.

Place in the data flow: called by ``model/builder.py`` when ``model.linear_attention_freq`` is set (docs/QWEN35.md).
The builder hands over its local layer spec (THD attention, packed RoPE, SP-aware norms); this module turns it
into the per-layer specs of one pipeline stage:

    layer i, linear_attention_freq[i] == 1   self_attention = megatron's GatedDeltaNet with local linears
                                             (in_proj ColumnParallelLinear [q|k|v|z|beta|alpha], out_proj
                                             RowParallelLinear, out_norm our plain RMSNorm, ``HeadsRMSNorm``:
                                             the gated output norm of HF's ``Qwen3_5RMSNormGated`` is not
                                             zero-centred; its gradient summed over TP)
    layer i, linear_attention_freq[i] == 0   the builder's attention layer (with ``attention_output_gate``:
                                             megatron's sigmoid output gate, q and gate projected together)

megatron-core's own spec function for these models (``get_transformer_block_with_experimental_attention_
variant_spec``) needs TransformerEngine; this is its local equivalent.

The padding rule: a GDN layer carries a recurrent state along the sequence and ignores ``attention_mask``. It
must only ever see packed THD input (``data/packing.py``), where every sequence starts at a ``cu_seqlens``
boundary with a zero state and any alignment padding sits at the END of its sequence (a causal layer's outputs
for real tokens never depend on later tokens). Left padding would enter the state: a hybrid model refuses
any input without packed ``packed_seq_params`` (``packed_gdn_class``).

Requirements (``validate``): megatron-core >= 0.18 (packed GDN input, NVIDIA/Megatron-LM PR #2644; 0.16.1's
GDN raises "GDN does not support packed sequence"); the local layer spec; no context parallelism (megatron's GDN
implements it with its own all-to-alls over the packed sequences, never run with megatron_rl's CP packing,
``data/packing.py: split_for_cp``); dense MLPs; TP dividing both GDN head counts. Without fla (always on a CPU;
on a GPU where it is not installed, with a warning) ``patches/fla_standins.py`` (P12) supplies torch versions of
fla's functions.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import importlib.util
import warnings

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from packaging.version import Version

from megatron_rl.config import ModelConfig, ParallelConfig, on_cpu
from megatron_rl.model.norm import RMSNorm

MIN_MCORE = "0.18.0"
"""First megatron-core release whose GatedDeltaNet accepts packed (THD) input."""


def is_hybrid(model_cfg: ModelConfig) -> bool:
    return model_cfg.linear_attention_freq is not None


def mcore_supports_hybrid(version: str | None = None) -> bool:
    """Whether the installed (or given) megatron-core has packed Gated-DeltaNet layers."""
    version = version or importlib.metadata.version("megatron-core")
    return Version(version) >= Version(MIN_MCORE)


def validate(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> None:
    """ValueError (one line, naming the field and the fix) for a hybrid model this build cannot run."""
    if not is_hybrid(model_cfg):
        return
    installed = importlib.metadata.version("megatron-core")
    if not mcore_supports_hybrid(installed):
        raise ValueError(f"model.linear_attention_freq (a hybrid Gated-DeltaNet model such as Qwen3.5) needs "
                         f"megatron-core>={MIN_MCORE} (packed GDN input); {installed} is installed: use the "
                         "megatron-core 0.19.2 environment (Python >= 3.12)")
    if parallel_cfg.context_parallel_size > 1:
        raise ValueError(f"parallel.context_parallel_size={parallel_cfg.context_parallel_size} with "
                         "model.linear_attention_freq: context parallelism is not supported for Gated-DeltaNet "
                         "models yet (untested with megatron_rl's CP packing); set context_parallel_size=1")
    if model_cfg.num_moe_experts is not None:
        raise ValueError("model.num_moe_experts with model.linear_attention_freq: hybrid MoE models (Qwen3.5-MoE, "
                         "Qwen3-Next) are not supported yet; use a dense hybrid model")
    if model_cfg.attention_backend == "te":
        raise ValueError("model.attention_backend='te' with model.linear_attention_freq: the hybrid layer spec is "
                         "local only; set attention_backend='local' (or 'auto')")
    tp = parallel_cfg.tensor_model_parallel_size
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(model_cfg, field) % tp != 0:
            raise ValueError(f"model.{field}={getattr(model_cfg, field)} is not divisible by "
                             f"tensor_model_parallel_size={tp}; choose a TP size dividing it")
    if not on_cpu(parallel_cfg.device) and importlib.util.find_spec("fla") is None:
        warnings.warn("model.linear_attention_freq on CUDA without flash-linear-attention: Gated-DeltaNet runs "
                      "megatron_rl's torch stand-ins (patches/fla_standins.py; correct, one sequence at a time); "
                      "pip install flash-linear-attention for its Triton kernels", stacklevel=2)


def transformer_config_kwargs(model_cfg: ModelConfig) -> dict:
    """megatron-core ``TransformerConfig`` fields of the hybrid layers, the output gate and the norm scale."""
    kwargs = {"attention_output_gate": model_cfg.attention_output_gate,
              "layernorm_zero_centered_gamma": model_cfg.layernorm_zero_centered_gamma}
    if not is_hybrid(model_cfg):
        return kwargs
    return {
        **kwargs,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": list(model_cfg.linear_attention_freq),
        "linear_conv_kernel_dim": model_cfg.linear_conv_kernel_dim,
        "linear_key_head_dim": model_cfg.linear_key_head_dim,
        "linear_value_head_dim": model_cfg.linear_value_head_dim,
        "linear_num_key_heads": model_cfg.linear_num_key_heads,
        "linear_num_value_heads": model_cfg.linear_num_value_heads,
    }


class ZeroCenteredRMSNorm(RMSNorm):
    """``y = (x / sqrt(mean(x**2, -1) + eps)) * (1 + weight)`` in fp32, cast to x's dtype at the end (HF's
    ``Qwen3_5RMSNorm``, including its rounding order); ``weight`` starts at 0. Sequence-parallel aware (P7)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused: object):
        super().__init__(config, hidden_size, eps)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class HeadsRMSNorm(RMSNorm):
    """The Gated-DeltaNet output norm (``out_norm``): one weight over a head's channels, applied to this TP rank's
    heads only, so each TP rank's weight gradient is a partial sum over its heads. Under sequence parallelism
    ``finalize_model_grads`` sums it over TP (the ``sequence_parallel`` tag); without, megatron-core 0.19.2 leaves
    it partial (its GDN tags nothing: measured, TP2 gave a 97% relative error on this gradient), so the weight
    goes through ``copy_to_tensor_model_parallel_region`` (identity forward, TP all-reduce of its gradient)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused: object):
        super().__init__(config, hidden_size, eps)
        self.sum_over_tp = config.tensor_model_parallel_size > 1 and not config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sum_over_tp:
            return self.normalize(x, self.weight)
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return self.normalize(x, copy_to_tensor_model_parallel_region(self.weight))


def norm_class(model_cfg: ModelConfig) -> type[RMSNorm]:
    """The layer / q-k / final norm: zero-centred for ``layernorm_zero_centered_gamma``."""
    return ZeroCenteredRMSNorm if model_cfg.layernorm_zero_centered_gamma else RMSNorm


@functools.cache
def packed_gdn_class() -> type:
    """megatron's ``GatedDeltaNet`` that refuses input without packed THD parameters (the padding rule, module
    doc). Made on first use: megatron-core < 0.18 has no packed GDN to subclass."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class PackedGatedDeltaNet(GatedDeltaNet):
        def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise ValueError("a Gated-DeltaNet layer got unpacked input: it ignores attention_mask, so padding "
                                 "would enter its state; pass packed THD micro-batches (data/packing.py: pack)")
            return super().forward(hidden_states, attention_mask, *args, packed_seq_params=packed_seq_params,
                                   **kwargs)

    return PackedGatedDeltaNet


def _gdn_layer(attention_layer: ModuleSpec) -> ModuleSpec:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    spec = copy.deepcopy(attention_layer)
    spec.submodules.self_attention = ModuleSpec(
        module=packed_gdn_class(),
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=HeadsRMSNorm,
                                           out_proj=RowParallelLinear),
    )
    return spec


def stage_layer_specs(config: TransformerConfig, model_cfg: ModelConfig, pp_rank: int,
                      attention_layer: ModuleSpec) -> list[ModuleSpec]:
    """The layer specs of pipeline stage ``pp_rank``: GDN or ``attention_layer`` per ``linear_attention_freq``."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    gdn = _gdn_layer(attention_layer)
    return [gdn if model_cfg.linear_attention_freq[i] else attention_layer for i in range(offset, offset + count)]
