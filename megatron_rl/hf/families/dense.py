"""Dense transformers read and written through mbridge: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms).

Place in the data flow: ``hf/config.py`` takes the per-type fields from ``DenseFamily.types``; ``hf/weights.py``
builds the mbridge bridge ``DenseFamily.bridges`` names (``hf/mbridge.py: make_bridge``) and moves the tensors with it. A dense
family of your own (a renamed Llama, docs/HF.md section 8) is a ``DenseFamily`` with its own ``model_types``,
``types`` and ``bridges``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from megatron_rl.hf.families.base import Family


@dataclass(frozen=True)
class DenseFamily(Family):
    """A family whose weights mbridge converts (every layer's MLP dense unless a subclass says otherwise)."""

    types: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``model_type`` -> the ``ModelConfig`` fields it sets (e.g. qwen2: ``add_qkv_bias=True``)."""
    bridges: dict[str, str] = field(default_factory=dict)
    """``model_type`` -> the mbridge model type whose bridge converts it (default: the same name)."""
    grouped_experts: bool = False
    """The model has MoE experts (``hf/weights.py``: mbridge sees them under TE's grouped names)."""

    def mbridge_type(self, model_type: str) -> str:
        return self.bridges.get(model_type, model_type)

    def problems(self, hf_config: Any) -> list[str]:
        allows_qkv_bias = self.types.get(hf_config.model_type, {}).get("add_qkv_bias", False)
        return [] if allows_qkv_bias else super().problems(hf_config)

    def model_fields(self, hf_config: Any) -> dict[str, Any]:
        return dict(self.types.get(hf_config.model_type, {}))

    def builds(self, model_cfg: Any) -> bool:
        return not self.grouped_experts and model_cfg.num_moe_experts is None and model_cfg.linear_attention_freq is None

    def hf_config_kwargs(self, model_cfg: Any) -> tuple[str, dict[str, Any]]:
        flags = {name: True for name in ("qk_layernorm", "add_qkv_bias") if getattr(model_cfg, name)}
        for model_type, fields in self.types.items():
            if fields == flags:
                extra = {"intermediate_size": model_cfg.ffn_hidden_size}
                return model_type, extra if fields.get("add_qkv_bias") else {**extra, "attention_bias": False}
        return super().hf_config_kwargs(model_cfg)

    def load_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> None:
        from megatron_rl.hf.mbridge import mbridge_views

        self.stage_stream(model_chunks, hf_dir, groups, model_cfg, hf_config).load_weights(
            mbridge_views(model_chunks), str(hf_dir))

    def iter_weights(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        from megatron_rl.hf.mbridge import mbridge_views

        bridge = self.stage_stream(model_chunks, hf_dir, groups, model_cfg, hf_config)
        for name, tensor in bridge.export_weights(mbridge_views(model_chunks, merge_adapters=merge_adapters)):
            yield name, tensor.detach().to("cpu", copy=True).contiguous()

    def stage_stream(self, model_chunks: list, hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                     hf_config: Any) -> Any:
        from megatron_rl.hf.mbridge import stage_bridge

        return stage_bridge(model_chunks, hf_config, groups, bridge_type=self.mbridge_type(hf_config.model_type),
                            grouped_experts=self.grouped_experts)


DENSE = DenseFamily(
    name="dense", model_types=("llama", "qwen2", "qwen3"),
    types={"llama": {}, "qwen2": {"add_qkv_bias": True}, "qwen3": {"qk_layernorm": True}},
)
"""Llama, Qwen2, Qwen3 (mbridge's bridges of the same names)."""
