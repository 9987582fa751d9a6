"""MegatronPolicy: the training backend's public face (``forward``, ``forward_backward``, ``optim_step``).

Place in the data flow (DESIGN.md section 1): takes a *global* mini-batch (``TrainingBatch``, identical on every
rank), and runs it through megatron-core under TP/PP/DP:

    global batch [B, ...]                              validated here, before any collective
      | pad_to_multiple(dp_size)                       dummy rows: loss_mask 0
      | plan_microbatches (model/microbatch.py)        every rank computes every DP rank's plan: equal counts
      | this DP rank's micro-batches -> pack (THD)     [1, T] per micro-batch
      v
    megatron-core get_forward_backward_func            PP schedule (1F1B) or no-pipelining
      | last stage: vocab-parallel logprobs/entropy    [1, T] -> unpack_response -> [b, R] right-aligned
      | forward:  rows back in order, broadcast from the last PP stage, all-gathered over DP, padding stripped
      | next_token_logprobs: same path; the head keeps each row's last position, full-vocab log-softmax [b, V]
      | training: loss_fn(...) -> summed loss x num_microbatches x dp_size (model/scaling.py)
      v
    optim_step: finalize_model_grads (DP average, SP/embedding all-reduces), clip, Adam/SGD, LR schedule

Gradient finalization is deferred: the schedule's ``finalize_model_grads_func`` is unset, so several
``forward_backward`` calls accumulate into DDP's grad buffers and ``optim_step`` finalizes once. N calls on
parts of a mini-batch followed by one ``optim_step`` equal one call on the whole (the scaling is linear and
per-call; the DP average happens once).

Pipeline micro-batches of different packed lengths: the builder sets ``variable_seq_lengths=True`` (so
megatron-core's p2p exchanges each activation's shape first) and packs keep their own lengths. Measured on the
2-core CPU box (PP2, 32 rows of 16-128 tokens, token budget 256, median of 5 forward_backward calls): 150 ms
with variable lengths vs 215 ms when every pack is extended to the call's longest pack with a dummy tail
sequence (``data.packing.pad_packed_to``) and fixed shapes (213 ms with both). The tail is used only when a
model's config has ``variable_seq_lengths=False`` (0.16.1 accepts True for dense models only together with
``moe_token_dispatcher_type="alltoall"``, which the builder sets).

Process groups: DDP, the optimizer and the schedule read megatron-core's ``parallel_state`` (initialized by
``distributed.bootstrap``); our own collectives use the explicit groups of ``ParallelGroups``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch, dummy_rows
from megatron_rl.data.packing import PackedBatch, pack, packing_alignment, unpack_response
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.distributed.metrics import reduce_metrics
from megatron_rl.metrics import Metric, merge_metrics
from megatron_rl.model import scaling
from megatron_rl.model.microbatch import MicroBatchPlan, dp_shard_range, packed_lengths, plan_microbatches, restore_order

LossFn = Callable[[torch.Tensor, torch.Tensor | None, Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, dict]]
"""``loss_fn(logprobs [b,R], entropy [b,R] | None, mb_tensors, loss_config) -> (summed_loss, dict[str, Metric])``."""

PER_TOKEN_KEYS = (
    "response_mask", "loss_mask", "rewards", "rollout_logprobs", "old_logprobs", "ref_logprobs",
    "advantages", "returns", "values",
)  # fmt: skip


@dataclass
class _MicroBatch:
    rows: list[int]
    """Global row indices of the DP-padded batch; empty for a dummy micro-batch (equal counts across DP)."""
    tensors: dict[str, torch.Tensor]
    """``[b, ...]`` slices of every batch tensor, on the device (one all-masked row for a dummy)."""
    packed: PackedBatch
    """THD pack of ``tensors["sequences"]`` (``[1, T]``, T the call's common length under PP)."""


@dataclass
class _Run:
    """One call's view of the batch on this rank."""

    num_rows: int
    """Rows of the caller's batch (before DP padding)."""
    response_width: int
    plan: MicroBatchPlan
    first_row: int
    """First global row of this DP rank's shard."""
    shard_rows: int
    microbatches: list[_MicroBatch]
    seq_length: int
    """The largest pack of the call (all DP ranks): the p2p shape when packs are extended to one length."""


class MegatronPolicy:
    """A Megatron GPT model (one chunk per PP stage) with DDP, optimizer and LR schedule, or frozen.

    role="policy": trainable (Megatron DDP with grad buffers, ``get_megatron_optimizer``, LR warmup/decay).
    role="reference": frozen, forward only (e.g. the KL reference), same forward path.
    ``total_optim_steps`` is the decay horizon when ``optimizer.lr_decay_steps`` is None.
    """


    def __init__(
        self,
        config: MegatronRLConfig,
        groups: ParallelGroups,
        *,
        role: Literal["policy", "reference"] = "policy",
        pad_token_id: int = 0,
        total_optim_steps: int | None = None,
    ) -> None:
        from megatron_rl.model.builder import build_gpt_model

        if role not in ("policy", "reference"):
            raise ValueError(f"MegatronPolicy role={role!r} is not valid; use 'policy' or 'reference'")
        if not 0 <= pad_token_id < config.model.vocab_size:
            raise ValueError(
                f"pad_token_id={pad_token_id} is outside the vocabulary [0, {config.model.vocab_size}); "
                "pass the tokenizer's pad id"
            )
        self.config, self.groups, self.role, self.pad_token_id = config, groups, role, pad_token_id
        self.device = groups.device
        self.align = packing_alignment(groups.tp_size, groups.cp_size, config.parallel.sequence_parallel)
        module = build_gpt_model(config.model, config.parallel, groups)
        # Grads are finalized once per optimizer step, in optim_step (module docstring).
        module.config.finalize_model_grads_func = None
        self.optimizer = self.scheduler = None
        if role == "reference":
            for param in module.parameters():
                param.requires_grad_(False)
            self.model = module.eval()
        else:
            self.model = _wrap_ddp(module, config)
            self.optimizer = _build_optimizer(self.model, config)
            self.scheduler = _build_scheduler(self.optimizer, config, total_optim_steps)
        self._grads_finalized = False

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel chunk of this rank (under the DDP wrapper for role='policy')."""
        return self.model.module if self.role == "policy" else self.model

    # ------------------------------------------------------------------ public API

    def forward(self, batch: TrainingBatch, *, compute_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per-token log-probs (and entropy) of the responses: ``{"logprobs": [B,R], "entropy": [B,R]}``.

        Same result on every rank; columns outside a row's response window are 0 (mask with response_mask).
        """
        run = self._prepare(batch)
        self.model.eval()
        with torch.no_grad():
            stores = self._run_schedule(run, partial(self._forward_head, compute_entropy=compute_entropy), True)
        names = ["logprobs"] + (["entropy"] if compute_entropy else [])
        stacked = None
        if self.groups.is_last_stage:
            per_mb = [torch.stack([s[n] for n in names], dim=-1) for s in stores]  # [b, R, k]
            stacked = restore_order(per_mb, run.plan, run.first_row)  # [B/dp, R, k]
        gathered = self._gather_rows(run, stacked, (run.response_width, len(names)))  # [B, R, k]
        return {name: gathered[..., i] for i, name in enumerate(names)}

    def next_token_logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Log-softmax over the vocabulary of the token after each row's last valid token: ``[n, V]`` fp32.

        ``sequences`` ``[n, S]`` int64 left-padded contexts, ``attention_mask`` ``[n, S]`` (DESIGN.md section 2);
        V = ``config.model.vocab_size`` (vocabulary padding excluded). The path of ``forward``: the rows are
        sharded over DP (every rank passes the same global contexts), run through the pipeline schedule
        (forward only), and the last stage's rows are broadcast over PP and all-gathered over DP, so every
        rank gets the same table. One position per row is kept, so the full vocabulary is cheap here.
        """
        n = len(sequences)
        no_responses = torch.zeros((n, 0), dtype=attention_mask.dtype)  # R = 0: _validate and DP padding need it
        tensors = {"sequences": sequences, "attention_mask": attention_mask, "response_mask": no_responses}
        batch = TrainingBatch(tensors, [None] * n, [None] * n, [True] * n)
        run = self._prepare(batch)
        self.model.eval()
        with torch.no_grad():
            stores = self._run_schedule(run, self._next_token_head, True)
        stacked = None
        if self.groups.is_last_stage:
            stacked = restore_order([s["next_token_logprobs"] for s in stores], run.plan, run.first_row)  # [n/dp, V]
        return self._gather_rows(run, stacked, (self.config.model.vocab_size,))  # [n, V]

    def forward_backward(
        self, batch: TrainingBatch, loss_fn: LossFn, loss_config: Any, *, compute_entropy: bool = False
    ) -> dict[str, Metric]:
        """Accumulate the gradient of ``sum over micro-batches and DP ranks of loss_fn(...)``; return metrics.

        Metrics are merged over micro-batches, reduced over DP and taken from the last PP stage: identical on
        every rank. Gradients are finalized by ``optim_step`` (or ``finalize_grads``).
        """
        if self.role != "policy":
            raise ValueError("forward_backward needs role='policy'; this MegatronPolicy is a frozen reference")
        if self._grads_finalized:
            raise ValueError(
                "forward_backward after finalize_grads() would all-reduce some gradients twice; call optim_step() "
                "or zero_grad() first"
            )
        run = self._prepare(batch)
        self._dry_run_loss(run, loss_fn, loss_config, compute_entropy)
        self.model.train()
        head = partial(
            self._loss_head, loss_fn=loss_fn, loss_config=loss_config, compute_entropy=compute_entropy,
            num_microbatches=len(run.microbatches),
        )  # fmt: skip
        stores = self._run_schedule(run, head, False)
        local = merge_metrics(*stores) if self.groups.is_last_stage else {}
        return reduce_metrics(local, self.groups.dp_group, self.groups.pp_group)

    def finalize_grads(self) -> None:
        """DP average of the grad buffers, SP-norm and tied-embedding all-reduces; once per optimizer step."""
        from megatron.core.distributed import finalize_model_grads

        if not self._grads_finalized:
            finalize_model_grads([self.model])
            self._grads_finalized = True

    def optim_step(self) -> dict[str, float]:
        """Finalize, clip, step the optimizer and the LR schedule, zero the grads: ``{"grad_norm", "lr"}``.

        The k-th step (1-based) uses the schedule's LR at k: the first warmup step already moves the weights.
        """
        if self.role != "policy":
            raise ValueError("optim_step needs role='policy'; this MegatronPolicy is a frozen reference")
        self.finalize_grads()
        self.scheduler.step(1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        success, grad_norm, _ = self.optimizer.step()
        if self.config.optimizer.clip_grad <= 0:  # Megatron only measures the norm when it clips
            grad_norm = self.optimizer.get_grad_norm()
        self.zero_grad()
        return {"grad_norm": float(grad_norm) if success else float("nan"), "lr": lr}

    def zero_grad(self) -> None:
        """Drop accumulated gradients (DDP grad buffers and optimizer grads)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_finalized = False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Single-process (TP/PP-unsharded) state dict, on every rank (model/weights.py)."""
        from megatron_rl.model.weights import full_state_dict

        return full_state_dict(self.module, self.groups)

    def load_full_state_dict(self, full_sd: Mapping[str, torch.Tensor]) -> None:
        """Load a single-process state dict into this rank's shard; the optimizer's main params follow."""
        from megatron_rl.model.weights import load_full_state_dict

        load_full_state_dict(self.module, full_sd, self.groups)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def save_checkpoint(self, path: str, trainer_state: dict[str, Any]) -> str:
        """Distributed checkpoint of model, optimizer and LR schedule plus ``trainer_state`` (checkpoint/)."""
        from megatron_rl.checkpoint.dist import save_checkpoint

        return str(save_checkpoint(self, path, trainer_state))

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> dict[str, Any]:
        """Restore from ``path`` (a checkpoint or its save_dir: the latest); returns the trainer state."""
        from megatron_rl.checkpoint.dist import load_checkpoint

        return load_checkpoint(self, path, load_optimizer=load_optimizer and self.optimizer is not None)

    # ------------------------------------------------------------------ preparation

    def _prepare(self, batch: TrainingBatch) -> _Run:
        """Validate, DP-pad, plan and pack: everything that can fail happens here, before any collective."""
        self._validate(batch)
        padded, _ = batch.pad_to_multiple(self.groups.dp_size, self.pad_token_id)
        lengths = padded["attention_mask"].sum(dim=1).tolist()
        batch_cfg = self.config.batch
        plans = plan_microbatches(
            lengths, self.groups.dp_size, micro_batch_size=batch_cfg.micro_batch_size,
            max_tokens_per_micro_batch=batch_cfg.max_tokens_per_micro_batch, align=self.align,
        )  # fmt: skip
        aligned = packed_lengths(lengths, self.align)
        seq_length = max(sum(aligned[r] for r in mb) if mb else self.align for p in plans for mb in p)
        fixed_shapes = self.groups.pp_size > 1 and not self.module.config.variable_seq_lengths
        target = seq_length if fixed_shapes else None
        plan = plans[self.groups.dp_rank]
        first_row, end_row = dp_shard_range(len(padded), self.groups.dp_size, self.groups.dp_rank)
        return _Run(
            num_rows=len(batch),
            response_width=batch["response_mask"].shape[1],
            plan=plan,
            first_row=first_row,
            shard_rows=end_row - first_row,
            microbatches=[self._microbatch(padded, rows, target) for rows in plan],
            seq_length=seq_length,
        )

    def _microbatch(self, padded: TrainingBatch, rows: list[int], target_len: int | None) -> _MicroBatch:
        if rows:
            index = torch.tensor(rows, dtype=torch.long)
            tensors = {k: v[index].to(self.device) for k, v in padded.tensors.items()}
        else:
            tensors = {k: dummy_rows(k, v, 1, self.pad_token_id).to(self.device) for k, v in padded.tensors.items()}
        packed = pack(tensors["sequences"], tensors["attention_mask"], self.align, target_len=target_len)
        return _MicroBatch(rows=rows, tensors=tensors, packed=packed)

    def _validate(self, batch: TrainingBatch) -> None:
        """ValueError naming the field for inputs the model cannot take (runs on every rank, no collective)."""
        for key in ("sequences", "attention_mask", "response_mask"):
            if key not in batch:
                raise ValueError(f"batch has no {key!r} tensor (keys: {batch.keys()}); build it with TrainingBatch")
        if len(batch) == 0:
            raise ValueError("batch has 0 rows; pass at least one sequence")
        sequences, attention_mask = batch["sequences"], batch["attention_mask"]
        if sequences.dtype.is_floating_point:
            raise ValueError(f"batch['sequences'] has dtype {sequences.dtype}; token ids must be an integer tensor")
        if sequences.dim() != 2 or attention_mask.shape != sequences.shape:
            raise ValueError(
                f"batch['attention_mask'] has shape {tuple(attention_mask.shape)} but batch['sequences'] has "
                f"{tuple(sequences.shape)}; both must be [B, S]"
            )
        width = batch["response_mask"].shape[1]
        for key in PER_TOKEN_KEYS:
            if key in batch and tuple(batch[key].shape) != (len(batch), width):
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected [B, R] = {(len(batch), width)} "
                    "like batch['response_mask']; per-token tensors must be right-aligned to one width"
                )
        if width >= sequences.shape[1]:
            raise ValueError(
                f"batch['response_mask'] width R={width} must be smaller than the sequence width S="
                f"{sequences.shape[1]} (every response follows at least one prompt token)"
            )
        self._validate_tokens(sequences, attention_mask)

    def _validate_tokens(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> None:
        model_cfg = self.config.model
        tokens = sequences[attention_mask.bool()]
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= model_cfg.vocab_size):
            bad = int(tokens.max()) if int(tokens.max()) >= model_cfg.vocab_size else int(tokens.min())
            raise ValueError(
                f"batch['sequences'] holds token id {bad}, outside the vocabulary [0, model.vocab_size="
                f"{model_cfg.vocab_size}); check the tokenizer matches the model"
            )
        lengths = attention_mask.sum(dim=1)
        if int(lengths.min()) < 1:
            raise ValueError(
                f"batch['attention_mask'] row {int(lengths.argmin())} has no valid token; every row needs at least one"
            )
        if int(lengths.max()) > model_cfg.max_position_embeddings:
            raise ValueError(
                f"batch['sequences'] row {int(lengths.argmax())} has {int(lengths.max())} tokens, more than "
                f"model.max_position_embeddings={model_cfg.max_position_embeddings}; shorten the rollouts "
                "(e.g. the generator's max length) or raise model.max_position_embeddings"
            )

    # ------------------------------------------------------------------ the Megatron stage

    def _run_schedule(self, run: _Run, head: Callable, forward_only: bool) -> list:
        """megatron-core's schedule over this rank's micro-batches; returns what ``head`` reported (last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            p = item.packed
            output = model(p.input_ids, p.position_ids, None, packed_seq_params=p.packed_seq_params())
            return output, partial(head, item)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(run.microbatches),
            model=[self.model],
            num_microbatches=len(run.microbatches),
            seq_length=run.seq_length,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _token_outputs(
        self, item: _MicroBatch, logits: torch.Tensor, compute_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last stage: logits ``[1, T, V/tp]`` -> response logprobs / entropy ``[b, R]`` (fp32)."""
        from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy

        width = item.tensors["response_mask"].shape[1]
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            logits, item.packed.labels, self.groups.tp_group, compute_entropy,
            valid_vocab_size=self.config.model.vocab_size,
        )
        logprobs = unpack_response(logprobs, item.packed, width)
        entropy = unpack_response(entropy, item.packed, width) if entropy is not None else None
        return logprobs, entropy

    def _forward_head(self, item: _MicroBatch, logits: torch.Tensor, *, compute_entropy: bool):
        logprobs, entropy = self._token_outputs(item, logits, compute_entropy)
        rows = len(item.rows)  # 0 for a dummy micro-batch: its outputs are dropped
        out = {"logprobs": logprobs[:rows]}
        if entropy is not None:
            out["entropy"] = entropy[:rows]
        return logits.new_zeros(()), out

    def _next_token_head(self, item: _MicroBatch, logits: torch.Tensor):
        """Last stage: logits ``[1, T, V/tp]`` -> full-vocab log-probs after each row's last token ``[b, V]``."""
        from megatron_rl.model.logprobs import vocab_parallel_log_softmax

        packed = item.packed
        last = (packed.cu_seqlens[: packed.num_rows] + packed.seq_lens - 1).long()  # [b] last valid token
        logprobs = vocab_parallel_log_softmax(
            logits[0, last], self.groups.tp_group, valid_vocab_size=self.config.model.vocab_size
        )  # [b, V]
        return logits.new_zeros(()), {"next_token_logprobs": logprobs[: len(item.rows)]}  # dummy: 0 rows

    @staticmethod
    @torch.no_grad()
    def _dry_run_loss(run: _Run, loss_fn: LossFn, loss_config: Any, compute_entropy: bool) -> None:
        """Run ``loss_fn`` once on zero log-probs of the first micro-batch, on every rank, before the schedule.

        Inside the schedule the loss runs on the last pipeline stage only: an error there (a missing batch key,
        a bad config) would leave the other stages waiting forever for its gradient. Here every rank raises.
        """
        tensors = run.microbatches[0].tensors
        zeros = torch.zeros_like(tensors["response_mask"], dtype=torch.float32)  # [b, R]
        loss_fn(zeros, zeros if compute_entropy else None, tensors, loss_config)

    def _loss_head(
        self, item: _MicroBatch, logits: torch.Tensor, *, loss_fn: LossFn, loss_config: Any,
        compute_entropy: bool, num_microbatches: int,
    ):  # fmt: skip
        logprobs, entropy = self._token_outputs(item, logits, compute_entropy)
        summed, metrics = loss_fn(logprobs, entropy, item.tensors, loss_config)
        if not summed.requires_grad:  # e.g. a loss that returns a constant for an all-masked micro-batch
            summed = summed + 0.0 * logprobs.sum()
        reported = metrics if item.rows else {}  # a dummy micro-batch's metrics would skew max/min
        return scaling.scale_loss_for_megatron(
            summed, reported, num_microbatches=num_microbatches, dp_size=self.groups.dp_size
        )

    def _gather_rows(self, run: _Run, local: torch.Tensor | None, row_shape: tuple[int, ...]) -> torch.Tensor:
        """Shard ``[B/dp, *row_shape]`` on the last PP stage -> ``[B, *row_shape]`` on every rank, padding rows
        stripped (``row_shape`` e.g. ``(R, k)``)."""
        shape = (run.shard_rows, *row_shape)
        if local is None:
            local = torch.empty(shape, dtype=torch.float32, device=self.device)
        local = local.contiguous()
        assert tuple(local.shape) == shape, (tuple(local.shape), shape)
        pp_group = self.groups.pp_group
        if self.groups.pp_size > 1:
            dist.broadcast(local, src=dist.get_global_rank(pp_group, self.groups.pp_size - 1), group=pp_group)
        if self.groups.dp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.groups.dp_size)]
            dist.all_gather(parts, local, group=self.groups.dp_group)
            local = torch.cat(parts, dim=0)
        return local[: run.num_rows]


# ---------------------------------------------------------------------- construction helpers


def _wrap_ddp(module: torch.nn.Module, config: MegatronRLConfig) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)


def _build_optimizer(model: torch.nn.Module, config: MegatronRLConfig) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

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


def _build_scheduler(optimizer: Any, config: MegatronRLConfig, total_optim_steps: int | None) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
