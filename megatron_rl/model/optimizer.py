"""Construction of the trainable stage: Megatron DDP wrapper, optimizer, LR schedule, and the optimizer's
refresh after the weights change underneath it.

Place in the data flow (docs/DESIGN.md section 1): built once by ``MegatronPolicy(role="policy")``; the policy's
``optim_step`` drives them. DDP and the optimizer read megatron-core's ``parallel_state`` (initialized by
``distributed.bootstrap``).
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.config import MegatronRLConfig
from megatron_rl.distributed.bootstrap import ParallelGroups


def wrap_ddp(module: torch.nn.Module, config: MegatronRLConfig, groups: ParallelGroups) -> DistributedDataParallel:
    """Megatron DDP with fp32 grad buffers; grads are reduced once per optimizer step (no overlap); the process
    groups are passed explicitly (megatron-core's newer API; no fallback to its globals)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module,
                                   pg_collection=groups.pg_collection)


def build_optimizer(model: DistributedDataParallel, config: MegatronRLConfig) -> MegatronOptimizer:
    """``get_megatron_optimizer`` for ``config.optimizer`` (Adam or SGD; bf16 keeps fp32 main params)."""
    opt = config.optimizer
    if opt.use_distributed_optimizer and opt.optimizer != "adam":
        raise ValueError(
            f"optimizer.use_distributed_optimizer=True needs optimizer.optimizer='adam' (got {opt.optimizer!r}): "
            "megatron-core's distributed optimizer supports Adam only; set use_distributed_optimizer=False"
        )
    bf16 = config.model.params_dtype == "bfloat16"
    megatron_cfg = OptimizerConfig(
        optimizer=opt.optimizer,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return get_megatron_optimizer(megatron_cfg, [model])


def build_scheduler(
    optimizer: MegatronOptimizer, config: MegatronRLConfig, total_optim_steps: int | None
) -> OptimizerParamScheduler:
    """Warmup then decay; the decay horizon is ``optimizer.lr_decay_steps`` or else ``total_optim_steps``."""
    opt = config.optimizer
    decay_steps = opt.lr_decay_steps if opt.lr_decay_steps is not None else total_optim_steps
    if decay_steps is None:
        if opt.lr_decay_style != "constant":
            raise ValueError(
                f"optimizer.lr_decay_style={opt.lr_decay_style!r} needs optimizer.lr_decay_steps (or "
                "MegatronPolicy(total_optim_steps=...)); set one of them or use lr_decay_style='constant'"
            )
        decay_steps = opt.lr_warmup_steps + 1  # unused by the constant style; megatron wants warmup < decay
    if opt.lr_warmup_steps >= decay_steps:
        raise ValueError(
            f"optimizer.lr_warmup_steps={opt.lr_warmup_steps} must be smaller than the decay horizon "
            f"{decay_steps} (optimizer.lr_decay_steps or the run's total steps)"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_steps > 0 else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


def follow_new_weights(optimizer: MegatronOptimizer | None) -> None:
    """After the model's weights were replaced in place (full state dict, HF weights, a weights-only checkpoint):
    refresh the optimizer's main (fp32) copies, taken when it was built, or the next step writes the old
    weights back. No-op for a frozen model (``optimizer is None``). The one place that does this."""
    if optimizer is not None:
        optimizer.reload_model_params()
