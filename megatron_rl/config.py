"""Configuration schema of megatron_rl.

Dataclasses are the single schema (DESIGN.md section 8). YAML files in ``configs/`` are serialized overrides
of these defaults; dotted ``key=value`` arguments override the YAML. Unknown keys and wrong types are errors
that name the key and the closest valid key. Each dataclass validates the fields it owns in ``validate()``;
cross-section rules live in ``MegatronRLConfig.validate``.

Names passed to megatron-core keep megatron-core's spelling (``tensor_model_parallel_size``, not ``tp``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")
TEMPORAL_ESTIMATORS = ("gae", "reinforce++")


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel group size (megatron-core name)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel stages (megatron-core name)."""
    context_parallel_size: int = 1
    """Context-parallel group size. Only 1 is supported today; kept for the scaling contract."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor_model_parallel_size > 1)."""


@dataclass(kw_only=True)
class ModelConfig:
    hf_path: str | None = None
    """Local Hugging Face checkpoint directory to import weights, shapes and tokenizer from (no downloads).
    When set, the shape fields below are taken from the checkpoint's config.json."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """SwiGLU intermediate width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); equal to num_attention_heads for MHA."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    vocab_size: int = 128
    """Vocabulary size (padded to a multiple of tensor_model_parallel_size by the builder if needed)."""
    max_position_embeddings: int = 512
    """Longest sequence the model accepts; longer inputs are rejected with a ValueError."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    layernorm_epsilon: float = 1e-6
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
    """'te' = TransformerEngine spec, 'local' = portable packed SDPA attention, 'auto' = te if importable."""
    init_method_std: float = 0.02
    """Std of the random weight init (ignored when hf_path is set)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: Literal["adam", "sgd"] = "adam"
    """Megatron optimizer type (the distributed optimizer supports adam only)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_warmup_steps: int = 0
    """Linear warmup in optimizer steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR decay after warmup."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which the LR decays; None = total steps of the run when known."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer)."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage_estimator: str = "grpo"
    """Registered estimator: grpo, rloo, reinforce++, gae."""
    grpo_norm_by_std: bool = True
    """GRPO divides by the group std; False gives Dr. GRPO's mean-only baseline."""
    gamma: float = 1.0
    """Discount for temporal estimators (gae, reinforce++)."""
    lambd: float = 1.0
    """GAE lambda."""
    policy_loss_type: str = "regular"
    """Registered policy loss: regular, dual_clip, gspo, cispo, cross_entropy, importance_sampling."""
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How the summed loss is normalized (through the advantages, per mini-batch; DESIGN.md section 5)."""
    max_seq_len: int | None = None
    """Normalizer of seq_mean_token_sum_norm, and the length past which batch conversion warns."""
    eps_clip_low: float = 0.2
    """PPO lower clip: ratio >= 1 - eps_clip_low."""
    eps_clip_high: float = 0.2
    """PPO upper clip: ratio <= 1 + eps_clip_high."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) (token mean) to the loss."""
    use_kl_in_reward: bool = False
    """Subtract kl_loss_coef * KL from the token rewards instead."""
    kl_loss_coef: float = 0.001
    """KL weight (loss or reward)."""
    kl_estimator_type: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus weight (token mean); 0 disables the entropy computation."""
    advantage_whitening: bool = False
    """Whiten advantages over the whole batch (masked mean/var) before per-mini-batch normalization."""
    off_policy_correction: Literal["none", "token_tis", "sequence_tis"] = "none"
    """Truncated importance sampling with rollout logprobs (needs rollout_logprobs)."""
    tis_cap: float = 2.0
    """Cap of the truncated importance ratio."""
    value_clip: float = 0.2
    """Critic value clip range."""


@dataclass(kw_only=True)
class BatchConfig:
    train_batch_size: int = 4
    """Prompts per training batch (one train_step)."""
    policy_mini_batch_size: int = 2
    """Prompts per mini-batch; one optimizer step each."""
    n_samples_per_prompt: int = 4
    """Rollouts per prompt (group size)."""
    micro_batch_size: int | None = 4
    """Rows per micro-batch per DP rank; exclusive with max_tokens_per_micro_batch."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro-batch (packed tokens, hard cap); exclusive with micro_batch_size."""
    update_epochs_per_batch: int = 1
    """Passes over each training batch."""


@dataclass(kw_only=True)
class StepWiseConfig:
    step_wise_trajectories: bool = False
    """One sequence per turn; advantages broadcast from each trajectory's last step."""
    merge_stepwise_output: bool = False
    """Prefix-aware merging of consecutive turns (needs step_wise_trajectories)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save_dir: str | None = None
    """Directory of distributed checkpoints; None = <logging.output_dir>/checkpoints."""
    save_interval: int = 0
    """Save every N train steps; 0 = only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept on disk."""
    resume: bool = True
    """Resume from the latest complete checkpoint in save_dir if there is one."""
    save_timeout_s: float = 600.0
    """Abort a save that takes longer (the previous checkpoint stays)."""


@dataclass(kw_only=True)
class LoggingConfig:
    output_dir: str = "outputs/run"
    """Where metrics, TensorBoard events, checkpoints and plots go."""
    log_interval: int = 1
    """Train steps between metric lines."""
    tensorboard: bool = True
    """Write TensorBoard events (if tensorboard is installed)."""
    progress_bar: bool = True
    """Live progress bar on rank 0."""


@dataclass(kw_only=True)
class MegatronRLConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    stepwise: StepWiseConfig = field(default_factory=StepWiseConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 1234
    """Global seed (weights, sampling, data order)."""
