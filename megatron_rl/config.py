"""Configuration schema of megatron_rl.

Dataclasses are the single schema (docs/DESIGN.md section 8). YAML files are serialized overrides of these defaults;
dotted ``key=value`` arguments override the YAML (``load_config``). Names passed to megatron-core keep
megatron-core's spelling (``tensor_model_parallel_size``, not ``tp``).

Validation runs once, when a config is built:

- each section (``ConfigSection``) checks the fields it owns in ``__post_init__``: the valid range declared next
  to each numeric field (``field(..., metadata=valid(...))``), ``Literal`` choices, and the section's own rules
  between its fields (``_check_rules``);
- the root ``MegatronRLConfig.__post_init__`` checks the rules that span sections (seed, algorithm x step-wise);
- the world-size rule (``ParallelConfig.check_world_size``) runs where the world size is known: in
  ``distributed.bootstrap.initialize_distributed``, or when a caller passes ``world_size`` to ``load_config``.

``load_config`` builds every section from its final values (YAML, then overrides), so each rule runs once per
load. A config mutated after construction can be re-checked with ``MegatronRLConfig.validate()`` (the Trainer
does, once). Every user mistake raises ``ConfigError`` (a ``ValueError``) naming the dotted key, the value and
the valid range or fix; unknown keys get a suggestion (an alias table of common names, then the closest key).

Algorithm names are owned by the registries of ``megatron_rl.algorithms``: this module imports its validators;
``algorithms`` never imports this module (it reads its settings through the ``AlgorithmSettings`` Protocol).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence

from megatron_rl.algorithms.validation import validate_algorithm_settings, validate_step_wise_algorithm
from megatron_rl.config_files import ConfigError, put_dotted, read_overrides
from megatron_rl.config_keys import (KEY_ALIASES, KEY_NOTES, Schema, build_config, check_keys,  # noqa: F401
                                     config_to_dict, write_yaml)
from megatron_rl.config_rules import (AT_LEAST_1, FINITE, NON_NEGATIVE, POSITIVE, UNIT,  # noqa: F401
                                      ConfigSection, check_fields, on_cpu, reported_as_config_error, valid)
from megatron_rl.data.microbatch import check_microbatch_rule
from megatron_rl.distillation.config import DistillationConfig


# --------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ParallelConfig(ConfigSection):
    SECTION: ClassVar[str] = "parallel"

    tensor_model_parallel_size: int = field(default=1, metadata=AT_LEAST_1)
    """Tensor-parallel group size (megatron-core name)."""
    pipeline_model_parallel_size: int = field(default=1, metadata=AT_LEAST_1)
    """Pipeline-parallel stages (megatron-core name)."""
    context_parallel_size: int = field(default=1, metadata=AT_LEAST_1)
    """Context-parallel group size (megatron-core name): each packed sequence is split into 2*cp chunks and
    CP rank r runs chunks r and 2*cp-1-r (docs/DESIGN.md "Context parallelism")."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor_model_parallel_size > 1)."""
    expert_model_parallel_size: int = field(default=1, metadata=AT_LEAST_1)
    """Expert parallelism (megatron-core name; mixture-of-experts models only): the experts of each MoE layer are
    split over this many ranks, which are data-parallel ranks for the dense parts (docs/MOE.md)."""
    expert_tensor_parallel_size: int | None = field(default=None, metadata=AT_LEAST_1)
    """Tensor parallelism inside each expert (megatron-core name); None = 1: each expert whole on its EP rank,
    also under TP ("parallel folding"; megatron-core's own default is tensor_model_parallel_size). Values > 1
    need CUDA: gloo has no uneven all-gather, which the dispatcher then uses."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the ranks run: ``auto`` = one CUDA GPU per rank with NCCL when CUDA is visible, else CPU with gloo;
    ``cuda`` requires a GPU per rank; ``cpu`` runs the ranks on CPU with gloo even when CUDA is present (e.g. more
    ranks than GPUs). Applied by ``distributed.bootstrap.initialize_distributed`` (docs/DESIGN.md section 11)."""

    def _check_rules(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "parallel.sequence_parallel=True has no effect with parallel.tensor_model_parallel_size=1; "
                "set sequence_parallel=false or tensor_model_parallel_size > 1"
            )

    @property
    def expert_tensor_size(self) -> int:
        """expert_tensor_parallel_size with its default (1) resolved."""
        return self.expert_tensor_parallel_size or 1

    def check_world_size(self, world_size: int) -> None:
        """The world size must divide by tp * pp * cp (and by etp * ep * pp for the experts); checked where the
        world size is known (bootstrap)."""
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        if world_size % model_parallel != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size * "
                f"pipeline_model_parallel_size * context_parallel_size = {model_parallel}; change the number of "
                "processes (NPROC) or the parallel sizes"
            )
        expert_parallel = self.expert_tensor_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % expert_parallel != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size * "
                f"expert_model_parallel_size * pipeline_model_parallel_size = {expert_parallel}; change the number "
                "of processes (NPROC) or parallel.expert_model_parallel_size"
            )


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face linear modules a LoRA adapter can target (docs/LORA.md section 1)."""
LORA_SERVABLE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM serves (its ``max_lora_rank`` choices, ``vllm/config/lora.py`` in vllm 0.32)."""


@dataclass(kw_only=True)
class LoraConfig(ConfigSection):
    """LoRA adapters on the policy's linear layers (docs/LORA.md): the base weights are frozen and only the
    adapters train. ``delta W = (alpha / rank) * B @ A`` per targeted Hugging Face module, as in ``peft``."""

    SECTION: ClassVar[str] = "model.lora"

    rank: int = field(default=0, metadata=NON_NEGATIVE)
    """Adapter rank r; 0 = no LoRA (full fine-tuning). One of the ranks vLLM serves: 1, 8, 16, 32, 64, 128, 256,
    320, 512."""
    alpha: float | None = field(default=None, metadata=POSITIVE)
    """LoRA alpha (the update is scaled by alpha / rank); None = rank (scale 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """Hugging Face names of the adapted linear layers (any of q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj); the fused QKV and gate/up projections carry one adapter per name."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B @ A (``peft``'s and vLLM's ``scaling``)."""
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def _check_rules(self) -> None:
        if self.rank not in (0, *LORA_SERVABLE_RANKS):
            raise ConfigError(f"model.lora.rank={self.rank} is not a rank vLLM can serve; choose 0 (off) or one of "
                              f"{list(LORA_SERVABLE_RANKS)}")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ConfigError(f"model.lora.target_modules={self.target_modules!r} must be a non-empty list of "
                              f"module names, e.g. [q_proj, v_proj] (any of {list(LORA_TARGET_MODULES)})")
        unknown = [name for name in self.target_modules if name not in LORA_TARGET_MODULES]
        if unknown:
            raise ConfigError(f"model.lora.target_modules has unknown module {unknown[0]!r}; choose among "
                              f"{list(LORA_TARGET_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"model.lora.target_modules={self.target_modules!r} names a module twice; list each "
                              "once")


@dataclass(kw_only=True)
class ModelConfig(ConfigSection):
    SECTION: ClassVar[str] = "model"

    hf_path: str | None = None
    """Local Hugging Face checkpoint directory to import weights, shapes and tokenizer from (no downloads).
    When set, the shape fields below are taken from the checkpoint's config.json."""
    family: str | None = None
    """The model family (``megatron_rl/hf/families``: how its HF checkpoints are read and written, what it
    supports): None = the family of ``hf_path``'s ``model_type`` (the resolved section names it: 'dense', 'moe',
    'qwen35'), or without ``hf_path`` the one that builds these shapes. A family of your own:
    ``path/to/file.py:NAME`` or ``package.module:NAME``, a ``Family`` object that file defines, imported by the
    pre-flight and every rank (docs/HF.md section 8)."""
    num_layers: int = field(default=2, metadata=AT_LEAST_1)
    """Transformer layers."""
    hidden_size: int = field(default=64, metadata=AT_LEAST_1)
    """Model width."""
    ffn_hidden_size: int = field(default=128, metadata=AT_LEAST_1)
    """SwiGLU intermediate width."""
    num_attention_heads: int = field(default=4, metadata=AT_LEAST_1)
    """Query heads."""
    num_query_groups: int = field(default=2, metadata=AT_LEAST_1)
    """Key/value heads (GQA); equal to num_attention_heads for MHA."""
    kv_channels: int | None = field(default=None, metadata=AT_LEAST_1)
    """Head dimension; None means hidden_size // num_attention_heads."""
    vocab_size: int = field(default=128, metadata=AT_LEAST_1)
    """Vocabulary size (padded to a multiple of tensor_model_parallel_size by the builder if needed)."""
    max_position_embeddings: int = field(default=512, metadata=AT_LEAST_1)
    """Longest sequence the model accepts; longer inputs are rejected with a ValueError."""
    rotary_base: float = field(default=10000.0, metadata=POSITIVE)
    """RoPE theta."""
    layernorm_epsilon: float = field(default=1e-6, metadata=POSITIVE)
    """RMSNorm epsilon."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter / compute dtype. bfloat16 is for GPUs."""
    attention_backend: Literal["auto", "local", "te"] = "auto"
    """'local' = portable packed attention (flash varlen on CUDA, SDPA on CPU); 'auto' = 'local' (TE is never
    picked silently); 'te' = TransformerEngine spec, an explicit opt-in that has not run on our machines."""
    init_method_std: float = field(default=0.02, metadata=POSITIVE)
    """Std of the random weight init (ignored when hf_path is set)."""
    num_moe_experts: int | None = field(default=None, metadata=AT_LEAST_1)
    """Mixture-of-experts: routed experts per layer (megatron-core name); None = a dense model (docs/MOE.md).
    Every layer is an MoE layer (Qwen3-MoE, Mixtral)."""
    moe_ffn_hidden_size: int | None = field(default=None, metadata=AT_LEAST_1)
    """Intermediate width of each expert's SwiGLU; None = ffn_hidden_size."""
    moe_router_topk: int = field(default=2, metadata=AT_LEAST_1)
    """Experts each token is routed to."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores over the experts."""
    moe_router_pre_softmax: bool = False
    """softmax over all experts before the top-k, weights not renormalized (Qwen3-MoE with norm_topk_prob=False);
    False = top-k of the logits, then softmax over the k chosen (Qwen3-MoE with norm_topk_prob=True, Mixtral)."""
    moe_router_load_balancing_type: Literal["seq_aux_loss", "none"] = "seq_aux_loss"
    """Load-balancing loss: ``seq_aux_loss`` is the switch-transformer loss of each sequence, averaged over the
    sequences of the mini-batch, so it does not depend on packing, micro-batches or layout (megatron-core's
    per-micro-batch ``aux_loss`` does; docs/MOE.md section 3); ``none`` disables it."""
    moe_aux_loss_coeff: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Weight of the load-balancing loss; 0 disables it."""
    moe_z_loss_coeff: float | None = field(default=None, metadata=NON_NEGATIVE)
    """Weight of the router z-loss (mean over the mini-batch's tokens of logsumexp(router logits)^2); None
    disables it."""
    moe_router_replay: Literal["none", "r2", "r3"] = "none"
    """Routing replay (docs/MOE.md section 5): ``r2`` records each token's experts in the old-log-prob forward
    and replays them in that step's training forwards; ``r3`` replays the experts the rollout engine chose
    (``routed_experts`` in the rollouts); ``none`` routes afresh in every forward."""
    linear_attention_freq: list[int] | None = None
    """Hybrid Gated-DeltaNet model (Qwen3.5, docs/QWEN35.md): one entry per layer, 1 = a Gated-DeltaNet (linear
    attention) layer, 0 = full attention; None = a plain transformer. Needs megatron-core >= 0.18."""
    linear_conv_kernel_dim: int = field(default=4, metadata=AT_LEAST_1)
    """Gated-DeltaNet: width of the causal depthwise convolution over q/k/v."""
    linear_key_head_dim: int = field(default=32, metadata=AT_LEAST_1)
    """Gated-DeltaNet: query/key head dimension."""
    linear_value_head_dim: int = field(default=32, metadata=AT_LEAST_1)
    """Gated-DeltaNet: value head dimension."""
    linear_num_key_heads: int = field(default=2, metadata=AT_LEAST_1)
    """Gated-DeltaNet: query/key heads."""
    linear_num_value_heads: int = field(default=4, metadata=AT_LEAST_1)
    """Gated-DeltaNet: value heads (a multiple of linear_num_key_heads)."""
    attention_output_gate: bool = False
    """Full attention multiplies each head's output by sigmoid(gate), the gate projected with the queries (Qwen3.5)."""
    rotary_percent: float = field(default=1.0, metadata=valid(0, 1, low_open=True))
    """Fraction of each head's channels that RoPE rotates (HF ``partial_rotary_factor``; Qwen3.5: 0.25)."""
    layernorm_zero_centered_gamma: bool = False
    """RMSNorm scales by (1 + weight), the weight initialized to 0 (Qwen3.5's layer, q/k and final norms)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``model.lora.*``; docs/LORA.md); off by default."""
    freeze_vision: bool = False
    """The vision tower is not trained nor synced to vLLM; export and checkpoints keep it (docs/VISION.md s. 13)."""

    def _check_rules(self) -> None:
        mlp_targets = [name for name in self.lora.target_modules if name in ("gate_proj", "up_proj", "down_proj")]
        if self.lora.enabled and self.num_moe_experts is not None and mlp_targets:
            raise ConfigError(f"model.lora.target_modules includes {mlp_targets[0]!r} but an MoE model's experts "
                              "carry no adapters; target the attention only: [q_proj, k_proj, v_proj, o_proj]")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}; choose num_query_groups dividing the head count"
            )
        if self.linear_attention_freq is not None:
            self._check_hybrid_rules()
        if self.num_moe_experts is None:
            moe_set = [name for name in ("moe_ffn_hidden_size", "moe_z_loss_coeff") if getattr(self, name) is not None]
            moe_set += ["moe_aux_loss_coeff"] if self.moe_aux_loss_coeff > 0 else []
            moe_set += ["moe_router_replay"] if self.moe_router_replay != "none" else []
            if moe_set:
                raise ConfigError(f"model.{moe_set[0]} is set but model.num_moe_experts is None (a dense model); set "
                                  "num_moe_experts or remove the MoE keys")
            return
        if self.moe_router_topk > self.num_moe_experts:
            raise ConfigError(f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts="
                              f"{self.num_moe_experts}; choose topk <= num_moe_experts")
        if self.moe_aux_loss_coeff > 0 and self.moe_router_load_balancing_type == "none":
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} with "
                              "model.moe_router_load_balancing_type='none'; set the type to 'seq_aux_loss' or the "
                              "coefficient to 0")

    def _check_hybrid_rules(self) -> None:
        pattern = self.linear_attention_freq
        if len(pattern) != self.num_layers or any(v not in (0, 1) for v in pattern):
            raise ConfigError(f"model.linear_attention_freq={pattern} must list 0 (attention) or 1 (Gated-DeltaNet) "
                              f"for each of the model.num_layers={self.num_layers} layers")
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ConfigError(f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                              f"model.linear_num_key_heads={self.linear_num_key_heads}; choose a multiple")


@dataclass(kw_only=True)
class OptimizerConfig(ConfigSection):
    SECTION: ClassVar[str] = "optimizer"

    optimizer: Literal["adam", "sgd"] = "adam"
    """Megatron optimizer type (the distributed optimizer supports adam only)."""
    lr: float = field(default=1e-6, metadata=POSITIVE)
    """Peak learning rate."""
    min_lr: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Floor of the decay schedule (<= lr)."""
    weight_decay: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Decoupled weight decay."""
    adam_beta1: float = field(default=0.9, metadata=valid(0, 1, high_open=True))
    """Adam beta1."""
    adam_beta2: float = field(default=0.999, metadata=valid(0, 1, high_open=True))
    """Adam beta2."""
    adam_eps: float = field(default=1e-8, metadata=POSITIVE)
    """Adam epsilon."""
    clip_grad: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Global gradient-norm clip; 0 disables."""
    lr_warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    """Linear warmup in optimizer steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR decay after warmup."""
    lr_decay_steps: int | None = field(default=None, metadata=AT_LEAST_1)
    """Optimizer steps over which the LR decays; None = total steps of the run when known."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer)."""

    def _check_rules(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr!r} is above optimizer.lr={self.lr!r}; "
                              "the decay floor must be <= the peak learning rate")
        if self.use_distributed_optimizer and self.optimizer != "adam":
            raise ConfigError(
                f"optimizer.use_distributed_optimizer=True needs optimizer.optimizer='adam' (got "
                f"{self.optimizer!r}): megatron-core's distributed optimizer supports Adam only"
            )


@dataclass(kw_only=True)
class AlgorithmConfig(ConfigSection):
    """The algorithm section; names are checked against the registries of ``megatron_rl.algorithms``."""

    SECTION: ClassVar[str] = "algorithm"

    advantage_estimator: str = "grpo"
    """Registered estimator (``algorithms.ADVANTAGE_ESTIMATORS``): grpo, rloo, reinforce++, gae."""
    grpo_norm_by_std: bool = True
    """GRPO divides by the group std; False gives Dr. GRPO's mean-only baseline."""
    gamma: float = field(default=1.0, metadata=UNIT)
    """Discount for temporal estimators (gae, reinforce++)."""
    lambd: float = field(default=1.0, metadata=UNIT)
    """GAE lambda."""
    policy_loss_type: str = "regular"
    """Registered policy loss (``algorithms.POLICY_LOSSES``): regular, dual_clip, gspo, cispo, cross_entropy,
    importance_sampling."""
    loss_reduction: str = "token_mean"
    """Registered reduction (``algorithms.LOSS_REDUCTIONS``): token_mean, sequence_mean, seq_mean_token_sum_norm.
    How the summed loss is normalized (through the advantages, per mini-batch; docs/DESIGN.md section 5)."""
    max_seq_len: int | None = field(default=None, metadata=AT_LEAST_1)
    """Longest prompt + response the run allows: batch conversion warns past it (never truncates), and it is
    the constant normalizer of seq_mean_token_sum_norm."""
    eps_clip_low: float = field(default=0.2, metadata=valid(0, 1, low_open=True))
    """PPO lower clip: ratio >= 1 - eps_clip_low."""
    eps_clip_high: float = field(default=0.2, metadata=POSITIVE)
    """PPO upper clip: ratio <= 1 + eps_clip_high."""
    clip_ratio_c: float = field(default=3.0, metadata=FINITE)
    """Dual-clip bound for negative advantages (> 1 with policy_loss_type='dual_clip')."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) (token mean) to the loss."""
    use_kl_in_reward: bool = False
    """Subtract kl_loss_coef * KL from the token rewards instead."""
    kl_loss_coef: float = field(default=0.001, metadata=NON_NEGATIVE)
    """KL weight (loss or reward)."""
    kl_estimator_type: str = "k3"
    """Registered KL estimator (``algorithms.KL_ESTIMATORS``): k1, k2, k3, abs."""
    entropy_loss_coef: float = field(default=0.0, metadata=FINITE)
    """Entropy bonus weight (token mean); 0 disables the entropy computation."""
    advantage_whitening: bool = False
    """Whiten advantages over the whole batch (masked mean/var) before per-mini-batch normalization."""
    off_policy_correction: str = "none"
    """Importance weight ``pi_old / pi_rollout`` of the sampled tokens in the loss (needs rollout_logprobs):
    none, token_tis, sequence_tis (truncated at tis_cap), token_mask, sequence_mis, sequence_mis_geo (0 outside
    [is_ratio_low, is_ratio_high]); formulas and when to use which: ``algorithms/off_policy.py``, docs/DESIGN.md
    section 16."""
    tis_cap: float = field(default=2.0, metadata=POSITIVE)
    """Cap of the truncated importance ratio (>= 1 with token_tis / sequence_tis)."""
    is_ratio_low: float = field(default=0.5, metadata=valid(0, 1, low_open=True, high_open=True))
    """Lower end of the band of the masking corrections: a token (token_mask) or sequence (sequence_mis,
    sequence_mis_geo) whose ratio is below it gets weight 0. In (0, 1); 0.5 with is_ratio_high 2.0 is a band
    symmetric in log space (kept while the trainer and the sampler agree within a factor 2)."""
    is_ratio_high: float = field(default=2.0, metadata=valid(1, low_open=True))
    """Upper end of that band (ratios above it get weight 0); > 1, finite. The default equals tis_cap's, so
    token_tis and token_mask agree on which tokens are too far off."""
    value_clip: float = field(default=0.2, metadata=NON_NEGATIVE)
    """Critic value clip range."""

    def _check_rules(self) -> None:
        with reported_as_config_error():
            validate_algorithm_settings(self)


@dataclass(kw_only=True)
class BatchConfig(ConfigSection):
    SECTION: ClassVar[str] = "batch"

    train_batch_size: int = field(default=4, metadata=AT_LEAST_1)
    """Prompts per training batch (one train_step)."""
    policy_mini_batch_size: int = field(default=2, metadata=AT_LEAST_1)
    """Prompts per mini-batch; one optimizer step each."""
    micro_batch_size: int | None = field(default=4, metadata=AT_LEAST_1)
    """Rows per micro-batch per DP rank; exclusive with max_tokens_per_micro_batch."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = field(default=None, metadata=AT_LEAST_1)
    """Token budget per micro-batch (packed tokens, hard cap); exclusive with micro_batch_size. ``auto``: derived
    from the model and the free memory (model/token_budget.py), never below the call's longest sequence, so no
    sequence is refused (configs/user_job.yaml's default)."""
    update_epochs_per_batch: int = field(default=1, metadata=AT_LEAST_1)
    """Passes over each training batch."""

    def _check_rules(self) -> None:
        if self.train_batch_size % self.policy_mini_batch_size != 0:
            raise ConfigError(
                f"batch.train_batch_size={self.train_batch_size} is not divisible by "
                f"batch.policy_mini_batch_size={self.policy_mini_batch_size}; both count prompts and the batch "
                "must split into whole mini-batches"
            )
        with reported_as_config_error():  # the rule's one home: data/microbatch.py (the planner checks it too)
            check_microbatch_rule(self.micro_batch_size, self.max_tokens_per_micro_batch)


@dataclass(kw_only=True)
class StepWiseConfig(ConfigSection):
    SECTION: ClassVar[str] = "stepwise"

    step_wise_trajectories: bool = False
    """One sequence per turn; advantages broadcast from each trajectory's last step."""
    merge_stepwise_output: bool = False
    """Prefix-aware merging of consecutive turns (needs step_wise_trajectories)."""

    def _check_rules(self) -> None:
        if self.merge_stepwise_output and not self.step_wise_trajectories:
            raise ConfigError(
                "stepwise.merge_stepwise_output=True needs stepwise.step_wise_trajectories=True; "
                "enable step-wise training or disable merging"
            )


@dataclass(kw_only=True)
class CheckpointConfig(ConfigSection):
    SECTION: ClassVar[str] = "checkpoint"

    save_dir: str | None = None
    """Directory of distributed checkpoints; None = <logging.output_dir>/checkpoints."""
    save_interval: int = field(default=0, metadata=NON_NEGATIVE)
    """Save every N train steps; 0 = only at the end."""
    keep_last: int = field(default=2, metadata=AT_LEAST_1)
    """Complete checkpoints kept on disk."""
    resume: bool = True
    """Resume from the latest complete checkpoint in save_dir if there is one."""
    resume_fallback: bool = True
    """When the newest checkpoint fails verification, move it aside (``.corrupt.step_N``) with a warning and
    resume from the newest one that verifies; False = strict: stop with the error instead."""
    save_timeout_s: float = field(default=600.0, metadata=POSITIVE)
    """Abort a save that takes longer (the previous checkpoint stays)."""


@dataclass(kw_only=True)
class LoggingConfig(ConfigSection):
    SECTION: ClassVar[str] = "logging"

    output_dir: str = "outputs/run"
    """Where metrics, TensorBoard events, checkpoints and plots go."""
    log_interval: int = field(default=1, metadata=AT_LEAST_1)
    """Train steps between metric lines."""
    tensorboard: bool = True
    """Write TensorBoard events (if tensorboard is installed)."""
    progress_bar: bool = True
    """Live progress bar on rank 0."""
    sample_interval: int = field(default=10, metadata=NON_NEGATIVE)
    """Main job: RL steps between sample records (0 = never; evaluations always write theirs): a few decoded
    (prompt, response, reward) records go to ``<output_dir>/samples.jsonl`` and TensorBoard text
    (``megatron_rl/job/reporting.py``)."""
    num_samples: int = field(default=4, metadata=AT_LEAST_1)
    """Main job: records per sample log (one response per prompt, the first prompts of the step)."""


@dataclass(kw_only=True)
class CriticConfig(ConfigSection):
    """The value model of PPO with a critic (docs/DESIGN.md section 13): the policy's trunk shape with a scalar
    head, trained beside the policy with its own learning rate, mini-batches and epochs. The value clip range is
    ``algorithm.value_clip`` and the loss reduction ``algorithm.loss_reduction`` (shared with the policy)."""

    SECTION: ClassVar[str] = "critic"

    enabled: bool | None = None
    """Train a critic; None = exactly when ``algorithm.advantage_estimator`` is 'gae' (which needs one)."""
    lr: float | None = field(default=None, metadata=POSITIVE)
    """Peak learning rate of the critic's optimizer (the rest of ``optimizer.*`` is shared); required when
    the critic is enabled."""
    mini_batch_size: int | None = field(default=None, metadata=AT_LEAST_1)
    """Prompts per critic mini-batch (one critic optimizer step each); None = batch.policy_mini_batch_size."""
    update_epochs_per_batch: int | None = field(default=None, metadata=AT_LEAST_1)
    """Critic passes over each training batch; None = batch.update_epochs_per_batch."""
    init_from_policy: bool = False
    """Start the critic's trunk from the policy's initial weights (e.g. an HF checkpoint; the head is always
    fresh); False = a random trunk (its own draw, not the policy's)."""

    def active(self, algorithm: "AlgorithmConfig") -> bool:
        """Whether a critic runs with this ``algorithm`` section (``enabled``, or implied by 'gae')."""
        return self.enabled if self.enabled is not None else algorithm.advantage_estimator == "gae"

    def updates(self, batch: "BatchConfig") -> tuple[int, int]:
        """``(prompts per critic mini-batch, critic epochs per batch)``, the policy's where unset."""
        return (self.mini_batch_size or batch.policy_mini_batch_size,
                self.update_epochs_per_batch or batch.update_epochs_per_batch)


def check_critic_rules(critic: CriticConfig, algorithm: AlgorithmConfig, batch: BatchConfig) -> None:
    """The ``critic`` section against ``algorithm`` and ``batch`` (called by ``MegatronRLConfig``)."""
    if algorithm.advantage_estimator == "gae" and critic.enabled is False:
        raise ConfigError("critic.enabled=false but algorithm.advantage_estimator='gae' needs critic values; set "
                          "critic.enabled=true (and critic.lr) or use an estimator without a critic ('grpo', 'rloo')")
    if not critic.active(algorithm):
        return
    if algorithm.advantage_estimator != "gae":
        warnings.warn(f"critic.enabled=true has no effect on the advantages with algorithm.advantage_estimator="
                      f"{algorithm.advantage_estimator!r} (only 'gae' reads values); the critic is trained anyway",
                      stacklevel=4)
    if critic.lr is None:
        raise ConfigError("critic.lr is not set; the critic (algorithm.advantage_estimator='gae' or "
                          "critic.enabled=true) needs its own learning rate, e.g. critic.lr=1e-3")
    size = critic.mini_batch_size
    if size is not None and batch.train_batch_size % size != 0:
        raise ConfigError(f"critic.mini_batch_size={size} does not divide batch.train_batch_size="
                          f"{batch.train_batch_size}; both count prompts and the batch must split into whole "
                          "critic mini-batches")


@dataclass(kw_only=True)
class MegatronRLConfig:
    """The library's configuration: the sections below plus ``seed`` (no application's fields)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    stepwise: StepWiseConfig = field(default_factory=StepWiseConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # megatron_rl/distillation
    seed: int = field(default=1234, metadata=valid(0, 2**32, high_open=True))
    """Global seed (weights, sampling, data order)."""

    def __post_init__(self) -> None:
        self._check_rules()  # the sections validated themselves when they were built

    def _check_rules(self) -> None:
        """The root's own fields and the rules that span sections."""
        check_fields(self, "")
        with reported_as_config_error():
            validate_step_wise_algorithm(self.algorithm, self.stepwise.step_wise_trajectories)
        check_critic_rules(self.critic, self.algorithm, self.batch)
        if self.model.lora.enabled and self.critic.active(self.algorithm):
            raise ConfigError(f"model.lora.rank={self.model.lora.rank} with a critic: the critic's value head is "
                              "not adapted by LoRA; set model.lora.rank=0 or use an estimator without a critic "
                              "('grpo', 'rloo')")

    def sections(self) -> list[ConfigSection]:
        values = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return [value for value in values if isinstance(value, ConfigSection)]

    def validate(self, world_size: int | None = None) -> None:
        """Re-run every rule, for a config mutated after construction; ``world_size`` adds the world-size rule."""
        for section in self.sections():
            section.validate()
        self.model.lora.validate()  # a section inside a section: validated on its own construction, like them
        self._check_rules()
        if world_size is not None:
            self.parallel.check_world_size(world_size)


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
) -> MegatronRLConfig:
    """Defaults <- YAML overrides at ``path`` (several files: each over the ones before) <- dotted ``key=value``
    overrides, validated once.

    ``world_size`` (optional) adds the world-size rule, which ``initialize_distributed`` checks anyway.
    Unknown keys, wrong types and out-of-range values raise ``ConfigError`` naming the key.
    """
    flat = read_overrides(path, overrides)
    check_keys(flat, Schema.of(MegatronRLConfig))
    cfg = build_config(MegatronRLConfig, flat)
    if world_size is not None:
        cfg.parallel.check_world_size(world_size)
    return cfg


def config_from_dict(data: Mapping[str, Any]) -> MegatronRLConfig:
    """Inverse of ``config_to_dict`` (validated)."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        put_dotted(flat, name, value, {})
    check_keys(flat, Schema.of(MegatronRLConfig))
    return build_config(MegatronRLConfig, flat)


def dump_config(cfg: MegatronRLConfig, path: str | Path) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives an equal config back."""
    write_yaml(config_to_dict(cfg), path)
