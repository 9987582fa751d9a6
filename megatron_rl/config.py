"""Configuration schema of megatron_rl.

Dataclasses are the single schema (DESIGN.md section 8). YAML files in ``configs/`` are serialized overrides
of these defaults; dotted ``key=value`` arguments override the YAML. Unknown keys and wrong types are errors
that name the key and the closest valid key. Each dataclass validates the fields it owns in ``validate()``;
cross-section rules live in ``MegatronRLConfig.validate``.

Names passed to megatron-core keep megatron-core's spelling (``tensor_model_parallel_size``, not ``tp``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

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
    """'local' = portable packed attention (flash varlen on CUDA, SDPA on CPU); 'auto' = 'local' (TE is never
    picked silently); 'te' = TransformerEngine spec, an explicit opt-in that has not run on our machines."""
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
    """Longest prompt + response the run allows: batch conversion warns past it (never truncates), and it is
    the constant normalizer of seq_mean_token_sum_norm."""
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
class DemoConfig:
    """The main job's toy RL loop (megatron_rl/main.py, megatron_rl/demo/); ignored by library use."""

    num_steps: int = 150
    """RL train steps of the main job (one batch of fresh rollouts each)."""
    num_turns: int = 3
    """Turns per episode of the next-digit game (megatron_rl/demo/environment.py)."""
    digit_offset: int = 1
    """The game's rule: the right answer to digit d is (d + digit_offset) mod 10."""
    max_new_tokens: int = 3
    """Response length cap per turn (the right answer takes 2 tokens: digit and stop token)."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 makes rollout and trainer log-probs comparable (mismatch metrics ~0)."""
    baseline_episodes: int = 2000
    """Episodes a uniformly random policy plays to estimate the random-baseline reward of the summary."""


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
    demo: DemoConfig = field(default_factory=DemoConfig)
    seed: int = 1234
    """Global seed (weights, sampling, data order)."""

    def validate(self, world_size: int | None = None) -> None:
        """Every load-time rule (``validate_config``); for configs built in code rather than loaded."""
        validate_config(self, world_size)


# --------------------------------------------------------------------------------------------------------------
# Loading, dumping, validation
# --------------------------------------------------------------------------------------------------------------


def _positive(section: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ValueError(f"{section}.{name}={value!r} must be positive; set it to an integer >= 1")


def validate_parallel_config(p: ParallelConfig, world_size: int | None) -> None:
    """Parallel sizes; with ``world_size`` also checks it divides by tp * pp * cp (bootstrap calls this)."""
    _positive("parallel", p, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        raise ValueError(
            "parallel.sequence_parallel=True has no effect with parallel.tensor_model_parallel_size=1; "
            "set sequence_parallel=false or tensor_model_parallel_size > 1"
        )
    if p.context_parallel_size != 1:
        raise ValueError(
            f"parallel.context_parallel_size={p.context_parallel_size} is not supported yet; set it to 1"
        )
    if world_size is None:
        return
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {model_parallel}; change the number of "
            "processes (NPROC) or the parallel sizes"
        )


def _validate_model(m: ModelConfig) -> None:
    _positive("model", m, ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                           "num_query_groups", "kv_channels", "vocab_size", "max_position_embeddings"))
    if m.num_attention_heads % m.num_query_groups != 0:
        raise ValueError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_query_groups={m.num_query_groups}; choose num_query_groups dividing the head count"
        )


def _validate_optimizer(o: OptimizerConfig) -> None:
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ValueError(f"optimizer.lr={o.lr} / optimizer.min_lr={o.min_lr}: need 0 <= min_lr <= lr")
    if o.lr_warmup_steps < 0:
        raise ValueError(f"optimizer.lr_warmup_steps={o.lr_warmup_steps} must be >= 0")
    if o.use_distributed_optimizer and o.optimizer != "adam":
        raise ValueError(
            f"optimizer.use_distributed_optimizer=True needs optimizer.optimizer='adam' (got {o.optimizer!r}): "
            "megatron-core's distributed optimizer supports Adam only"
        )


def _validate_algorithm(a: AlgorithmConfig, step_wise: bool) -> None:
    # The algorithms package owns its registries (estimators, losses, reductions); import lazily because it
    # imports this module.
    from megatron_rl.algorithms.validation import validate_algorithm_config

    validate_algorithm_config(a, step_wise)


def _validate_batch(b: BatchConfig) -> None:
    _positive("batch", b, ("train_batch_size", "policy_mini_batch_size", "n_samples_per_prompt",
                           "micro_batch_size", "max_tokens_per_micro_batch", "update_epochs_per_batch"))
    if b.train_batch_size % b.policy_mini_batch_size != 0:
        raise ValueError(
            f"batch.train_batch_size={b.train_batch_size} is not divisible by "
            f"batch.policy_mini_batch_size={b.policy_mini_batch_size}; both count prompts and the batch must "
            "split into whole mini-batches"
        )
    if (b.micro_batch_size is None) == (b.max_tokens_per_micro_batch is None):
        raise ValueError(
            f"set exactly one of batch.micro_batch_size ({b.micro_batch_size}) and "
            f"batch.max_tokens_per_micro_batch ({b.max_tokens_per_micro_batch}); set the other to null"
        )


def _validate_stepwise(s: StepWiseConfig) -> None:
    if s.merge_stepwise_output and not s.step_wise_trajectories:
        raise ValueError(
            "stepwise.merge_stepwise_output=True needs stepwise.step_wise_trajectories=True; "
            "enable step-wise training or disable merging"
        )


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _positive("checkpoint", c, ("keep_last", "save_timeout_s"))
    if c.save_interval < 0:
        raise ValueError(f"checkpoint.save_interval={c.save_interval} must be >= 0 (0 = only at the end)")


def validate_config(cfg: MegatronRLConfig, world_size: int | None = None) -> None:
    """Check every rule that can be checked without the model; ``world_size`` adds the divisibility check."""
    validate_parallel_config(cfg.parallel, world_size)
    _validate_model(cfg.model)
    _validate_optimizer(cfg.optimizer)
    _validate_algorithm(cfg.algorithm, cfg.stepwise.step_wise_trajectories)
    _validate_batch(cfg.batch)
    _validate_stepwise(cfg.stepwise)
    _validate_checkpoint(cfg.checkpoint)
    _positive("logging", cfg.logging, ("log_interval",))


def _closest(name: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.0)
    return f"; did you mean {prefix + match[0]!r}?" if match else ""


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation (after YAML parsing); int -> float is allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ValueError(f"{key}={value!r} is not one of {list(choices)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} must be a bool (true/false)")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}={value!r} must be an int")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}={value!r} must be a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={value!r} must be a string")
        return value
    return value


def _apply(obj: object, data: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ValueError(f"unknown config key {key!r}{_closest(name, fields, prefix)}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} is a section; give a mapping, not {value!r}")
            _apply(current, value, f"{key}.")
        else:
            setattr(obj, name, _coerce(key, value, hints[name]))


def _dotted_to_nested(overrides: typing.Sequence[str]) -> list[dict]:
    nested = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. optimizer.lr=1e-5)")
        dotted, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node: dict = {}
        root = node
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        nested.append(root)
    return nested


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    world_size: int | None = None,
) -> MegatronRLConfig:
    """Defaults <- YAML overrides at ``path`` <- dotted ``key=value`` overrides, then ``validate_config``.

    Unknown keys and wrong types raise ``ValueError`` naming the key and the closest valid key.
    """
    cfg = MegatronRLConfig()
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
        _apply(cfg, data, "")
    for nested in _dotted_to_nested(overrides):
        _apply(cfg, nested, "")
    validate_config(cfg, world_size)
    return cfg


def config_to_dict(cfg: MegatronRLConfig) -> dict:
    """Plain nested dict of the resolved config (YAML-serializable)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: MegatronRLConfig, path: str | Path) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives an equal config back."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def config_from_dict(data: dict) -> MegatronRLConfig:
    """Inverse of ``config_to_dict`` (validated)."""
    cfg = MegatronRLConfig()
    _apply(cfg, data, "")
    validate_config(cfg)
    return cfg
