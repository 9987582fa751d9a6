"""Mixture-of-experts transformers through mbridge: Qwen3-MoE (q/k norms) and Mixtral (docs/HF.md section 7).

Mapping (every layer must be an MoE layer):

    num_experts (qwen3_moe) / num_local_experts (mixtral) -> num_moe_experts
    moe_intermediate_size (qwen3_moe) / intermediate_size (mixtral) -> moe_ffn_hidden_size
    num_experts_per_tok -> moe_router_topk       softmax scores
    norm_topk_prob (qwen3_moe; mixtral: always True) -> moe_router_pre_softmax = not norm_topk_prob

HF's router: softmax over all experts, top-k, then (``norm_topk_prob``; Mixtral always) divide by the sum of
the k. megatron-core's ``moe_router_pre_softmax=True`` is softmax-then-top-k without renormalization; ``False``
is top-k of the logits, then a softmax over the k, which equals the renormalized top-k of the full softmax
(softmax is monotonic and the shared normalizer cancels; tests/hf/test_hf_moe.py compares both with
transformers). The load-balancing settings are training choices, not checkpoint facts: they stay the config's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.hf.families.dense import DenseFamily

QWEN3_MOE, MIXTRAL = "qwen3_moe", "mixtral"


@dataclass(frozen=True)
class MoEFamily(DenseFamily):
    grouped_experts: bool = True

    def problems(self, hf_config: Any) -> list[str]:
        problems = super().problems(hf_config)
        if hf_config.model_type == MIXTRAL and getattr(hf_config, "sliding_window", None) is not None:
            problems.append(f"sliding_window={hf_config.sliding_window} (sliding-window attention is not supported)")
        if hf_config.model_type == QWEN3_MOE:
            if getattr(hf_config, "decoder_sparse_step", 1) != 1:
                problems.append(f"decoder_sparse_step={hf_config.decoder_sparse_step} (every layer must be an MoE "
                                "layer: decoder_sparse_step=1)")
            if getattr(hf_config, "mlp_only_layers", None):
                problems.append(f"mlp_only_layers={list(hf_config.mlp_only_layers)} (dense layers among MoE layers "
                                "are not supported: mlp_only_layers=[])")
        return problems

    def model_fields(self, hf_config: Any) -> dict[str, Any]:
        if hf_config.model_type == QWEN3_MOE:
            experts, ffn, renormalize = hf_config.num_experts, hf_config.moe_intermediate_size, hf_config.norm_topk_prob
        else:
            experts, ffn, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
        return {**super().model_fields(hf_config), "num_moe_experts": experts, "moe_ffn_hidden_size": ffn,
                "moe_router_topk": hf_config.num_experts_per_tok, "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": not renormalize}

    def builds(self, model_cfg: Any) -> bool:
        return model_cfg.num_moe_experts is not None and model_cfg.linear_attention_freq is None

    def hf_config_kwargs(self, model_cfg: Any) -> tuple[str, dict[str, Any]]:
        """Qwen3-MoE when the model has q/k norms, else Mixtral (no q/k norms, renormalized top-k); ValueError
        naming the field for a router no HF architecture has."""
        ffn = model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
        if model_cfg.moe_router_score_function != "softmax":
            raise ValueError(f"model.moe_router_score_function={model_cfg.moe_router_score_function!r} has no HF "
                             "architecture here (Qwen3-MoE and Mixtral use softmax); set it to 'softmax'")
        if model_cfg.add_qkv_bias:
            raise ValueError("model.add_qkv_bias=True with num_moe_experts: no supported HF MoE architecture has "
                             "q/k/v biases; set add_qkv_bias=false")
        common = {"num_experts_per_tok": model_cfg.moe_router_topk, "router_aux_loss_coef": model_cfg.moe_aux_loss_coeff,
                  "attention_bias": False}
        if model_cfg.qk_layernorm:
            return QWEN3_MOE, {**common, "num_experts": model_cfg.num_moe_experts, "moe_intermediate_size": ffn,
                               "intermediate_size": model_cfg.ffn_hidden_size, "decoder_sparse_step": 1,
                               "mlp_only_layers": [], "norm_topk_prob": not model_cfg.moe_router_pre_softmax}
        if model_cfg.moe_router_pre_softmax:
            raise ValueError("model.moe_router_pre_softmax=True without qk_layernorm: Mixtral (the HF MoE architecture "
                             "without q/k norms) renormalizes the top-k; set moe_router_pre_softmax=false or "
                             "qk_layernorm=true (Qwen3-MoE with norm_topk_prob=false)")
        return MIXTRAL, {**common, "num_local_experts": model_cfg.num_moe_experts, "intermediate_size": ffn,
                         "sliding_window": None}


MOE = MoEFamily(name="moe", model_types=(QWEN3_MOE, MIXTRAL), types={QWEN3_MOE: {"qk_layernorm": True}, MIXTRAL: {}})
"""Qwen3-MoE and Mixtral (mbridge's bridges of the same names)."""
