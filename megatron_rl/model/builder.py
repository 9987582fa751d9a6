"""Model builder: ModelConfig + ParallelConfig -> megatron-core GPTModel for this rank's pipeline stage.

Place in the data flow (docs/DESIGN.md section 1): the "Megatron model (TP/PP)" box. Called once per model
(policy, reference) after ``initialize_distributed``; the result is wrapped by the policy (DDP, optimizer).

The model is Llama-style: RoPE, RMSNorm, SwiGLU MLP (``gated_linear_unit``: fc1 holds [gate; up]), GQA, no
linear biases except the optional QKV bias (Qwen2), optional q/k RMSNorm (Qwen3), tied or untied output layer.
With ``model.num_moe_experts`` every layer's MLP is megatron-core's MoE layer instead (top-k router, SwiGLU
experts, alltoall dispatcher, expert parallelism; ``model/moe.py``, docs/MOE.md). With
``model.linear_attention_freq`` some layers are Gated-DeltaNet layers (Qwen3.5; ``model/hybrid.py``, docs/QWEN35.md).
Logits stay vocab-sharded (``parallel_output=True``): ``[b, s, V_padded/tp]`` (``[1, T, V_padded/tp]`` packed)
on the last stage; feed them to ``megatron_rl.model.logprobs``.

Layer spec:
    TransformerEngine spec   attention_backend="te" only: an explicit opt-in (it has never run on a machine
                             of ours; TE cannot be installed on the lent GPU), never picked silently
    local spec               "local" and "auto" (the default; "auto" never means TE): megatron's
                             ``get_gpt_layer_local_spec`` with the core attention
                             replaced by ``PackedDotProductAttention`` (accepts THD, P8), the self-attention
                             by ``model.rotary.PackedRopeSelfAttention`` (RoPE from per-token positions, no
                             host sync), and every norm (layer, q/k, final) by ``model.norm.RMSNorm``
                             (sequence-parallel aware, P7)

Settings (docs/CPU_ADAPTATION.md section 3): ``use_cpu_initialization=True`` (identical full weights for every TP layout
under one seed; the model is moved to ``groups.device`` afterwards), ``perform_initialization=True``, all
fusions off, and ``variable_seq_lengths=True`` so pipeline stages accept packed micro-batches of different
lengths; 0.16.1 only allows that with ``moe_token_dispatcher_type="alltoall"`` (MoE's dispatcher, which has no
effect on a dense model). ``finalize_model_grads_func`` is NOT set here: the training wrapper sets it on
``model.config`` (without it the schedule performs no DP/SP/embedding gradient sync).

Vocabulary: padded up to a multiple of ``tensor_model_parallel_size`` (``padded_vocab_size``); the padded
logit columns are real (randomly initialized) outputs, so pass ``valid_vocab_size=model_cfg.vocab_size`` to
the log-prob function to exclude them.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model import hybrid, moe
from megatron_rl.model.attention import PackedDotProductAttention
from megatron_rl.model.norm import RMSNorm
from megatron_rl.model.rotary import PackedRopeSelfAttention

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` >= ``vocab_size`` (each TP rank holds an equal vocab shard)."""
    return -(-vocab_size // tp_size) * tp_size


def _divisible(field: str, value: int, by_name: str, by: int) -> None:
    if value % by != 0:
        raise ValueError(
            f"model.{field}={value} is not divisible by {by_name}={by}; choose {by_name} dividing {field} "
            f"(or change {field})"
        )


def _validate(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> None:
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    _divisible("num_attention_heads", model_cfg.num_attention_heads, "tensor_model_parallel_size", tp)
    _divisible("num_query_groups", model_cfg.num_query_groups, "tensor_model_parallel_size", tp)
    _divisible("ffn_hidden_size", model_cfg.ffn_hidden_size, "tensor_model_parallel_size", tp)
    _divisible("num_layers", model_cfg.num_layers, "pipeline_model_parallel_size", pp)
    _divisible("num_attention_heads", model_cfg.num_attention_heads, "model.num_query_groups",
               model_cfg.num_query_groups)
    if model_cfg.kv_channels is None:
        _divisible("hidden_size", model_cfg.hidden_size, "model.num_attention_heads", model_cfg.num_attention_heads)
    moe.validate(model_cfg, parallel_cfg)
    hybrid.validate(model_cfg, parallel_cfg)


def use_transformer_engine(model_cfg: ModelConfig) -> bool:
    """Whether the TE layer spec is used: only for attention_backend='te' (see module doc); ValueError for
    'te' without TE or CUDA. 'auto' is the local spec even where TE is importable."""
    if model_cfg.attention_backend != "te":
        return False
    if not (importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()):
        raise ValueError(
            "model.attention_backend='te' needs TransformerEngine and CUDA; install transformer-engine on a "
            "GPU machine or set attention_backend='local' (or 'auto')"
        )
    return True


def build_transformer_config(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> TransformerConfig:
    """megatron-core TransformerConfig for ``model_cfg`` under ``parallel_cfg`` (ValueError on bad shapes)."""
    _validate(model_cfg, parallel_cfg)
    dtype = _DTYPES[model_cfg.params_dtype]
    config = TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.kv_channels,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.add_qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Workarounds W1 and W3 (docs/MEGATRON_CORE.md; 0.16.1, still needed in 0.19.2): remove W1 when the
        # variable-length check applies to MoE only, W3 when megatron-core initializes identically on any device.
        use_cpu_initialization=True,
        perform_initialization=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # MoE's dispatcher; for dense models required by variable_seq_lengths
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **moe.transformer_config_kwargs(model_cfg, parallel_cfg),
        **hybrid.transformer_config_kwargs(model_cfg),
    )
    if model_cfg.num_moe_experts is not None:
        moe.configure_losses(config, model_cfg)
    return config


def _local_layer_spec(qk_layernorm: bool, moe_layer: bool = False, norm: type[RMSNorm] = RMSNorm) -> ModuleSpec:
    """megatron's local GPT layer spec with the THD attention (P8) and the SP-aware RMSNorm (P7; ``norm``, e.g.
    the zero-centred one of model/hybrid.py); the MLP is megatron's MoE layer with our router for ``moe_layer``
    (model/moe.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    layer = spec.submodules
    if moe_layer:
        layer.mlp = moe.moe_mlp_spec(qk_layernorm)
    layer.input_layernorm = norm
    layer.pre_mlp_layernorm = norm
    layer.self_attention.module = PackedRopeSelfAttention  # RoPE from per-token positions (model/rotary.py)
    attention = layer.self_attention.submodules
    attention.core_attention = PackedDotProductAttention
    if qk_layernorm:
        attention.q_layernorm = norm
        attention.k_layernorm = norm
    return spec


def _block_spec(config: TransformerConfig, model_cfg: ModelConfig, pp_rank: int, use_te: bool):
    """The decoder spec for this stage: TE layer spec, or local layers + our final norm."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model_cfg.qk_layernorm)
    # An explicit block spec sets the final norm (megatron would take the module global LayerNormImpl).
    norm = hybrid.norm_class(model_cfg)
    layer = _local_layer_spec(model_cfg.qk_layernorm, moe_layer=model_cfg.num_moe_experts is not None, norm=norm)
    if hybrid.is_hybrid(model_cfg):  # Gated-DeltaNet layers among these attention layers (model/hybrid.py)
        return TransformerBlockSubmodules(layer_specs=hybrid.stage_layer_specs(config, model_cfg, pp_rank, layer),
                                          layer_norm=norm)
    num_layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)


def build_gpt_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    groups: ParallelGroups,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    scatter_embedding: bool = True,
) -> GPTModel:
    """This rank's GPTModel stage (embedding on the first stage, output layer on the last by default);
    ``scatter_embedding=False``: under sequence parallelism the embedding's output stays whole (the caller
    scatters it: a vision-language model replaces image rows first, model/vision_language.py)."""
    use_te = use_transformer_engine(model_cfg)
    moe.validate(model_cfg, parallel_cfg, on_cpu=groups.device.type == "cpu")
    config = build_transformer_config(model_cfg, parallel_cfg)
    vocab = padded_vocab_size(model_cfg.vocab_size, parallel_cfg.tensor_model_parallel_size)
    if vocab != model_cfg.vocab_size:
        logger.warning("vocab_size %d padded to %d (multiple of tensor_model_parallel_size=%d)",
                       model_cfg.vocab_size, vocab, parallel_cfg.tensor_model_parallel_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(config, model_cfg, groups.pp_rank, use_te),
        vocab_size=vocab,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=groups.is_first_stage if pre_process is None else pre_process,
        post_process=groups.is_last_stage if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=model_cfg.rotary_base,
        rotary_percent=model_cfg.rotary_percent,
        pg_collection=groups.pg_collection,
        scatter_embedding_sequence_parallel=scatter_embedding,
    )
    if config.num_moe_experts is not None:
        moe.reduce_dense_marked_experts(model, parallel_cfg)
    return model.to(groups.device)
