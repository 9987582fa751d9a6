"""mbridge as our converter: a ``Bridge`` that speaks the local layer spec's names and our layout (the dense and
MoE families' weights, ``hf/families/dense.py``; ``hf/weights.py`` streams a stage with it).

We build the model ourselves (local or TE spec, ``model/builder.py``) and use mbridge 0.15.1 only to move
tensors: ``load_weights`` (tensor-parallel rank 0 of each stage reads the safetensors, converts, scatters the
TP shards) and ``export_weights`` (a collective generator: all-gathers TP shards, broadcasts over PP, yields HF
names and full tensors; every rank must run it to the end). What mbridge needs here (docs/HF.md section 3):

- two names of the local layer spec it does not know: ``input_layernorm.weight`` and
  ``pre_mlp_layernorm.weight`` (mbridge maps only TE's fused ``layer_norm_weight`` names);
- ``rope_theta`` set from transformers 5's ``rope_parameters``;
- per-instance name maps: ``Qwen2Bridge`` redirects ``output_layer.weight`` for tied embeddings by mutating
  its *class* dict, which would leak into every later Qwen2 bridge of the process; Llama has no such redirect;
- the parallel state taken from our ``ParallelGroups`` (mbridge would read megatron's globals, and would turn
  on sequence parallelism for TP > 1 in a config it builds for itself; that config is unused here);
- the vocabulary padding of ``model/builder.py`` (rows appended up to a multiple of TP: zero on import,
  dropped on export);
- mixture-of-experts (docs/HF.md section 7): mbridge knows only TE's grouped-expert names
  (``mlp.experts.linear_fc1.weight{j}``), so it sees each chunk through ``_GroupedExpertNames``, which renames
  our ``mlp.experts.local_experts.{j}.linear_fc1.weight`` to them (mbridge then maps local expert j of EP rank e
  to global expert ``e * n_local + j`` itself), and it gets the EP and expert-TP groups; its TP merge is told
  that a whole expert (expert_tensor_parallel_size 1) is not split over TP.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.hf.families.base import rope_theta
from megatron_rl.model import lora
from megatron_rl.model.weights import unwrap


# Workaround W12 (docs/MEGATRON_CORE.md; mbridge 0.15.1): remove the name maps and state set-up when mbridge fixes them.
def make_bridge(hf_config: Any, groups: ParallelGroups, dtype: torch.dtype, padded_vocab_size: int, *,
                bridge_type: str, grouped_experts: bool) -> Any:
    """An mbridge ``Bridge`` of type ``bridge_type`` (mbridge's ``model_type`` name: a family's
    ``DenseFamily.mbridge_type``) for ``hf_config`` that speaks our layer names and layout (module docstring).

    For an MoE checkpoint (``grouped_experts``) only the bridge's name maps and conversions are used: its own
    ``TransformerConfig`` hard-codes router settings (``moe_router_pre_softmax``, load balancing, grouped GEMM)
    that need not be ours. Pass it ``mbridge_views`` of the model chunks (``stage_bridge``'s callers do)."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.core.parallel_states import ParallelStates

    if bridge_type not in _MODEL_REGISTRY:
        raise ValueError(f"mbridge has no bridge {bridge_type!r} (it has {sorted(_MODEL_REGISTRY)}); name one in the "
                         "model family's bridges (hf/families/dense.py)")
    hf_config.rope_theta = rope_theta(hf_config)
    states = ParallelStates(
        tp_size=groups.tp_size, tp_rank=groups.tp_rank, pp_size=groups.pp_size, pp_rank=groups.pp_rank,
        vpp_size=None, cp_size=groups.cp_size, cp_rank=groups.cp_rank,
        ep_size=groups.ep_size, ep_rank=groups.ep_rank, etp_size=groups.etp_size, etp_rank=groups.etp_rank,
        tp_group=groups.tp_group, pp_group=groups.pp_group, cp_group=groups.cp_group,
        ep_group=groups.ep_group, etp_group=groups.etp_group,
    )  # fmt: skip
    bridge = _MODEL_REGISTRY[bridge_type](hf_config, dtype=dtype, parallel_states=states)  # AutoBridge, by name
    _set_name_maps(bridge, tied=bool(getattr(hf_config, "tie_word_embeddings", False)))
    if grouped_experts:
        _whole_experts_under_tp(bridge)
    bridge.make_vocab_size_divisible_by = groups.tp_size
    bridge.vocab_size, bridge.padded_vocab_size = hf_config.vocab_size, padded_vocab_size
    return bridge


def _set_name_maps(bridge: Any, tied: bool) -> None:
    """Instance-level copies of mbridge's name maps with the local-spec norms and the tied output layer."""
    bridge._DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "model.embed_tokens.weight" if tied else "lm_head.weight",
    }
    bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        **type(bridge)._MLP_MAPPING,
    }
    bridge._OTHER_MAPPING = {
        **type(bridge)._OTHER_MAPPING,
        "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    }
    bridge._get_hf_shared_weight_keys = lambda: ["model.embed_tokens.weight"] if tied else []


# Workaround W21 (docs/MEGATRON_CORE.md; mbridge 0.15.1): remove when mbridge's merge skips experts that
# expert_tensor_parallel_size=1 keeps whole.
def _whole_experts_under_tp(bridge: Any) -> None:
    """With TP > 1 and expert_tensor_parallel_size 1 every TP rank holds whole experts, but at EP1 mbridge's
    ``export_weights`` still all-gathers them over TP (they carry ``tensor_model_parallel``) and its
    ``_weight_merge_across_tp`` then asserts one piece per expert-TP rank; the TP copies are identical: keep one."""
    merge = bridge._weight_merge_across_tp

    def merge_whole_experts(name: str, weights: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
        if is_grouped_expert(name) and bridge.mpu.etp_size == 1:
            return weights[0]
        return merge(name, weights, param)

    bridge._weight_merge_across_tp = merge_whole_experts


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def grouped_expert_name(name: str) -> str:
    """Our (local-spec) expert parameter name -> TE's grouped name, the one mbridge maps; other names unchanged:
    ``decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight`` -> ``...mlp.experts.linear_fc1.weight3``
    (3 = the local expert index on this EP rank)."""
    match = _LOCAL_EXPERT.match(name)
    return name if match is None else f"{match[1]}{match[3]}{match[2]}"


def is_grouped_expert(name: str) -> bool:
    return ".mlp.experts.linear_fc" in name


# Workaround W20 (docs/MEGATRON_CORE.md; mbridge 0.15.1): remove when mbridge maps the local spec's
# SequentialMLP expert names (``local_experts.{j}``).
class _GroupedExpertNames:
    """One model chunk as mbridge sees it: parameters and state under ``grouped_expert_name``s.

    mbridge's ``load_weights`` and ``export_weights`` decide by name whether a tensor is an expert (split over the
    expert-TP group, gathered over EP) and read the local expert index from a ``weight{j}`` suffix; with the
    local-spec names they raise ``NotImplementedError`` (``mbridge/models/qwen2moe.py`` ~104) or, for the split,
    would treat an expert as a TP-split dense weight. Tensors are shared with the chunk (loading copies in place).
    """

    def __init__(self, chunk: torch.nn.Module, merge_adapters: bool = False) -> None:
        self.chunk = unwrap(chunk)
        self.decoder = getattr(self.chunk, "decoder", None)
        self._state: dict[str, torch.Tensor] | None = None
        self._adapted = lora.adapted_linears(self.chunk) if merge_adapters else {}

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The chunk's parameters; LoRA adapters are not HF weights: skipped, and with ``merge_adapters`` (export,
        weight sync) an adapted linear's weight is yielded merged (a new tensor, made when it is reached)."""
        for name, param in self.chunk.named_parameters():
            if lora.is_adapter_name(name):
                continue
            if name in self._adapted:
                param = lora.merged_weight(self._adapted[name], param)
            yield grouped_expert_name(name), param

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._state is None:  # mbridge asks once per tensor
            self._state = {grouped_expert_name(k): v for k, v in self.chunk.state_dict().items()
                           if not lora.is_adapter_name(k)}
        return self._state


def mbridge_views(model_chunks: list[torch.nn.Module], merge_adapters: bool = False) -> list[_GroupedExpertNames]:
    """The chunks as mbridge sees them (``_GroupedExpertNames``)."""
    return [_GroupedExpertNames(chunk, merge_adapters) for chunk in model_chunks]


def stage_bridge(model_chunks: list[torch.nn.Module], hf_config: Any, groups: ParallelGroups, *, bridge_type: str,
                 grouped_experts: bool) -> Any:
    """``make_bridge`` for these chunks: their dtype and padded vocabulary (one collective over PP)."""
    embedding_or_output = _vocab_parallel_rows(model_chunks[0])
    dtype = next(model_chunks[0].parameters()).dtype
    padded = _all_reduce_max(embedding_or_output, groups)
    return make_bridge(hf_config, groups, dtype, padded, bridge_type=bridge_type, grouped_experts=grouped_experts)


def _vocab_parallel_rows(chunk: torch.nn.Module) -> int:
    """Full (padded) vocabulary rows of this stage's embedding or output layer; 0 for a middle stage."""
    for name, param in chunk.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return param.shape[0] * getattr(chunk.config, "tensor_model_parallel_size", 1)
    return 0


def _all_reduce_max(value: int, groups: ParallelGroups) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=groups.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=groups.pp_group)
    return int(tensor.item())
