"""MegatronPolicy: the training backend's public face (``forward``, ``forward_backward``, ``optim_step``).

Place in the data flow (docs/DESIGN.md section 1): takes a *global* mini-batch (``TrainingBatch``, identical on every
rank), and runs it through megatron-core under TP/PP/DP:

    global batch [B, ...] (host)                       model/plan.py plan_call: validated, before any collective
      | pad_to_multiple(dp_size)                       dummy rows: loss_mask 0 (the only DP padding)
      | plan_microbatches (data/microbatch.py)         every rank computes every DP rank's plan: equal counts
      | this DP rank's micro-batches -> pack (THD)     [1, T] per micro-batch, on the host; one copy to device
      v
    model/schedule.py run_schedule                     megatron-core PP schedule (1F1B) or no-pipelining
      | last stage: vocab-parallel logprobs/entropy    [1, T] -> unpack_response -> [b, R] right-aligned
      | forward:  rows back in order, broadcast from the last PP stage, all-gathered over DP, padding stripped
      | next_token_logprobs: same path; the head keeps each row's last position, full-vocab log-softmax [b, V]
      | training: loss_fn(...) -> summed loss x num_microbatches x dp_size (model/scaling.py)
      v
    optim_step: finalize_model_grads (DP average, SP/embedding all-reduces), clip, Adam/SGD, LR schedule
                (DDP, optimizer and LR schedule are built by model/optimizer.py)

Device contract: this class is the one place that moves data to ``self.device`` (``plan.build_microbatch``, one
copy per tensor per micro-batch); results (``forward``, ``next_token_logprobs``) come back on the host and
metrics are Python floats. Checkpoints: ``megatron_rl.checkpoint.save_checkpoint(policy, ...)`` (the policy
does not import ``checkpoint/``).

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

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, Literal

import torch
from megatron.core.distributed import finalize_model_grads

from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.data.microbatch import AUTO_TOKEN_BUDGET, restore_order
from megatron_rl.data.packing import packing_alignment
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.distributed.metrics import reduce_metrics
from megatron_rl.metrics import Metric, merge_metrics, metrics_to_host
from megatron_rl.model import lora, moe, router_replay, schedule, token_budget
from megatron_rl.model.builder import build_gpt_model
from megatron_rl.model.kv_cache import KVCache
from megatron_rl.model.optimizer import build_optimizer, build_scheduler, follow_new_weights, wrap_ddp
from megatron_rl.model.plan import CallPlan, plan_call
from megatron_rl.model.schedule import LossFn
from megatron_rl.model.weights import full_state_dict, load_full_state_dict


class MegatronPolicy:
    """A Megatron GPT model (one chunk per PP stage) with DDP, optimizer and LR schedule, or frozen.

    role="policy": trainable (Megatron DDP with grad buffers, ``get_megatron_optimizer``, LR warmup/decay).
    role="reference": frozen, forward only (e.g. the KL reference), same forward path.
    role="critic": trainable like "policy"; set by ``model.critic.MegatronCritic``, which swaps the output layer
    for a value head (``build_module``) and the heads (``_forward_rows``, ``_loss_head``).
    ``pad_token_id`` is the one source of the padding token (the Trainer reads it from here).
    ``total_optim_steps`` is the decay horizon when ``optimizer.lr_decay_steps`` is None.
    """


    def __init__(
        self,
        config: MegatronRLConfig,
        groups: ParallelGroups,
        *,
        role: Literal["policy", "reference", "critic"] = "policy",
        pad_token_id: int = 0,
        total_optim_steps: int | None = None,
    ) -> None:
        if role not in ("policy", "reference", "critic"):
            raise ValueError(f"MegatronPolicy role={role!r} is not valid; use 'policy' or 'reference' (a critic: "
                             "megatron_rl.model.critic.MegatronCritic)")
        if not 0 <= pad_token_id < config.model.vocab_size:
            raise ValueError(
                f"pad_token_id={pad_token_id} is outside the vocabulary [0, {config.model.vocab_size}); "
                "pass the tokenizer's pad id"
            )
        self.config, self.groups, self.role, self.pad_token_id = config, groups, role, pad_token_id
        self.device = groups.device
        self.align = packing_alignment(groups.tp_size, groups.cp_size, config.parallel.sequence_parallel)
        module = self.build_module()
        if role == "policy" and config.model.lora.enabled:  # adapters on a frozen base (model/lora.py)
            lora.apply_lora(module, config.model, groups, seed=config.seed)
        # Grads are finalized once per optimizer step, in optim_step (module docstring).
        module.config.finalize_model_grads_func = None
        self.optimizer = self.scheduler = None
        if role == "reference":
            for param in module.parameters():
                param.requires_grad_(False)
            self.model = module.eval()
        else:
            self.model = wrap_ddp(module, config, groups)
            self.optimizer = build_optimizer(self.model, config)
            self.scheduler = build_scheduler(self.optimizer, config, total_optim_steps)
        self._grads_finalized = False
        self.auto_token_budget = None
        """``batch.max_tokens_per_micro_batch: auto``: the budget derived for this model (model/token_budget.py)."""
        if config.batch.max_tokens_per_micro_batch == AUTO_TOKEN_BUDGET:
            self.auto_token_budget = token_budget.derive_budget(config, groups, module, self.align)
        replay_on = role == "policy" and config.model.num_moe_experts is not None \
            and config.model.moe_router_replay != "none"
        self._routers = router_replay.policy_routers(self.module) if replay_on else None
        """This stage's routers under routing replay (model/router_replay.py); None: no replay (dense, off, or
        not the trained policy: a reference or critic never records or replays)."""

    def build_module(self) -> torch.nn.Module:
        """This rank's GPTModel stage (a subclass may swap the head: ``model/critic.py``)."""
        if self.config.model.freeze_vision:  # a vision-language checkpoint builds model/vision_policy.py's
            raise ValueError("model.freeze_vision=true but this model has no vision tower (a text model); set "
                             "model.freeze_vision=false, or model.hf_path to a vision-language checkpoint")
        return build_gpt_model(self.config.model, self.config.parallel, self.groups)

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel chunk of this rank (under the DDP wrapper unless role='reference')."""
        return self.model.module if self.role != "reference" else self.model

    # ------------------------------------------------------------------ public API

    def forward(self, batch: TrainingBatch, *, compute_entropy: bool = False,
                record_routing: bool = False) -> dict[str, torch.Tensor]:
        """Per-token log-probs (and entropy) of the responses: ``{"logprobs": [B,R], "entropy": [B,R]}``.

        Routing replay (``model.moe_router_replay``, model/router_replay.py): a batch holding ``routed_experts``
        ``[B, S, L, k]`` is run with that routing; ``record_routing=True`` adds ``"routed_experts"`` (the routing
        this forward chose, same layout; R2's recording).

        Same result on every rank, on the host. Column k of row i is ``log p(sequences[i, S-R+k] | the row's
        earlier tokens)`` (DESIGN.md section 2), so columns left of a row's response window hold the log-probs
        (and entropies) of its last prompt tokens, not 0; only columns where the row has no earlier token (a
        row shorter than R + 1 valid tokens) are 0. Mask with ``response_mask`` (or ``loss_mask``).
        """
        head = partial(schedule.forward_head, **self._head_args(), compute_entropy=compute_entropy)
        names = ["logprobs"] + (["entropy"] if compute_entropy else [])
        with self._routing_replay(batch, record=record_routing) as replay:
            out = self._forward_rows(batch, head, names, replay=replay)
            if record_routing:
                out[router_replay.ROUTED_EXPERTS] = replay.recorded_table()
        return out

    def _forward_rows(self, batch: TrainingBatch, head: schedule.Head, names: list[str], *,
                      replay: router_replay.ReplayCall | None = None) -> dict[str, torch.Tensor]:
        """Run ``head`` (it reports ``{name: [b, R]}``) forward only; every rank gets ``{name: [B, R]}`` (host)."""
        call = self.plan_call(batch)
        self._mode(training=False)
        with torch.no_grad():
            stores = schedule.run_schedule(self.model, call, head, self.groups, forward_only=True, replay=replay)
        stacked = None
        if self.groups.is_last_stage:
            per_mb = [torch.stack([s[n] for n in names], dim=-1) for s in stores]  # [b, R, k]
            stacked = restore_order(per_mb, call.plan, call.first_row)  # [B/dp, R, k]
        gathered = schedule.gather_rows(call, stacked, (call.response_width, len(names)), self.groups)  # [B, R, k]
        return {name: gathered[..., i] for i, name in enumerate(names)}

    def next_token_logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, *,
                            record_routing: bool = False, kv_cache: KVCache | None = None,
                            max_tokens_per_micro_batch: int | None = None,
                            images: tuple[torch.Tensor, torch.Tensor] | None = None, call: CallPlan | None = None,
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-softmax over the vocabulary of the token after each row's last valid token: ``[n, V]`` fp32.

        ``sequences`` ``[n, S]`` int64 left-padded contexts, ``attention_mask`` ``[n, S]`` (docs/DESIGN.md section 2);
        V = ``config.model.vocab_size`` (vocabulary padding excluded). The path of ``forward``: the rows are
        sharded over DP (every rank passes the same global contexts), run through the pipeline schedule
        (forward only), and the last stage's rows are broadcast over PP and all-gathered over DP, so every
        rank gets the same table (on the host). One position per row is kept, so the full vocabulary is cheap.
        ``record_routing=True`` (routing replay R3, the built-in sampler): returns ``(logprobs, routed_experts
        [n, S, L, k])``, the routing of every context token (model/router_replay.py).
        ``kv_cache`` (the built-in engine's incremental decoding, model/kv_cache.py): the rows continue the
        cache's rows (row i = cache row i, the same rows on every call) and hold only their new tokens.
        ``max_tokens_per_micro_batch``: plan this call by that token budget instead of ``config.batch``'s rule
        (a decoding step's one token per row fits one micro-batch).
        ``images``: the rows' ``(pixel_values [n, P, F], image_grid_thw [n, K, 3])`` (a ``VisionLanguagePolicy``;
        ``data/mrope.py: batch_images``).
        ``call``: this call's plan, made before for rows of the same lengths (a decoding step's: ``model/plan.py:
        with_tokens`` of ``plan_next_tokens``'s plan), instead of planning it again.
        """
        n = len(sequences)
        batch = next_token_batch(sequences, attention_mask, images)
        if call is None:
            call = self.plan_call(batch, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        if kv_cache is not None:
            if self.groups.cp_size > 1:
                raise ValueError("next_token_logprobs(kv_cache=...) does not support context parallelism "
                                 "(parallel.context_parallel_size > 1); decode without the cache")
            kv_cache.attach(call, n)
        head = partial(schedule.next_token_head, **self._head_args())
        self._mode(training=False)
        with torch.no_grad(), self._routing_replay(batch, record=record_routing) as replay:
            stores = schedule.run_schedule(self.model, call, head, self.groups, forward_only=True, replay=replay)
            routing = replay.recorded_table() if record_routing else None
        if kv_cache is not None:
            kv_cache.commit()
        stacked = None
        if self.groups.is_last_stage:
            stacked = restore_order([s["next_token_logprobs"] for s in stores], call.plan, call.first_row)  # [n/dp, V]
        logprobs = schedule.gather_rows(call, stacked, (self.config.model.vocab_size,), self.groups)  # [n, V]
        return (logprobs, routing) if record_routing else logprobs

    def plan_next_tokens(self, sequences: torch.Tensor, attention_mask: torch.Tensor, *,
                         max_tokens_per_micro_batch: int | None = None) -> CallPlan:
        """The plan ``next_token_logprobs`` makes for these rows (text only), to reuse for rows of the same lengths
        (``model/plan.py: with_tokens``)."""
        return self.plan_call(next_token_batch(sequences, attention_mask, None),
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch)

    def forward_backward(
        self, batch: TrainingBatch, loss_fn: LossFn, loss_config: Any, *, compute_entropy: bool = False,
        logits_term: schedule.LogitsTerm | None = None,
    ) -> dict[str, Metric]:
        """Accumulate the gradient of ``sum over micro-batches and DP ranks of loss_fn(...)``; return metrics.

        Metrics are merged over micro-batches, reduced over DP and taken from the last PP stage: identical on
        every rank. Gradients are finalized by ``optim_step`` (or ``finalize_grads``). ``logits_term``: per-token
        tensors from the logits for ``loss_fn`` (``schedule.LogitsTerm``; distillation's full_kl).
        """
        if self.role == "reference":
            raise ValueError("forward_backward needs role='policy'; this MegatronPolicy is a frozen reference")
        if self._grads_finalized:
            raise ValueError(
                "forward_backward after finalize_grads() would all-reduce some gradients twice; call optim_step() "
                "or zero_grad() first"
            )
        call = self.plan_call(batch)
        schedule.dry_run_loss(call, loss_fn, loss_config, compute_entropy)
        head = self._loss_head(loss_fn, loss_config, compute_entropy, len(call.microbatches), logits_term)
        moe_tokens = self._moe_tokens(call)
        with self._routing_replay(batch, record=False) as replay, _prepared(logits_term, call, self.groups):
            self._mode(training=True)
            stores = schedule.run_schedule(self.model, call, head, self.groups, forward_only=False,
                                           moe_tokens=moe_tokens, replay=replay)
            replay_metrics = replay.metrics() if replay is not None else {}
        local = merge_metrics(*metrics_to_host(stores)) if self.groups.is_last_stage else {}  # one device sync
        metrics = reduce_metrics(local, self.groups.dp_group, self.groups.pp_group)
        metrics.update(replay_metrics)
        if moe_tokens is not None:
            moe_values = moe.loss_metrics(moe_tokens, self.groups, self.config.model.num_layers)
            metrics.update({name: Metric(value, 1.0, "mean") for name, value in moe_values.items()})
        return metrics

    def _moe_tokens(self, call: CallPlan) -> moe.CallTokens | None:
        """What an MoE model's routers need for their auxiliary losses over this call (None: dense, or none on)."""
        if self.config.model.num_moe_experts is None or not moe.losses_enabled(self.config.model):
            return None
        return moe.call_tokens(call.num_rows, call.num_tokens, self.groups)

    @contextlib.contextmanager
    def _routing_replay(self, batch: TrainingBatch, *, record: bool) -> Iterator[router_replay.ReplayCall | None]:
        """The call's routing replay: record, replay ``batch['routed_experts']``, or None (no replay on, or the
        batch has no routing). Validates before any collective; clears the routers' replay state afterwards."""
        replaying = self._routers is not None and router_replay.ROUTED_EXPERTS in batch
        if record and self._routers is None:
            raise ValueError("record_routing=True needs an MoE policy with model.moe_router_replay 'r2' or 'r3' "
                             f"(this is role={self.role!r}, moe_router_replay={self.config.model.moe_router_replay!r})")
        if replaying and not record:
            router_replay.validate_routing(batch, self.config.model)
        if not (record or replaying):
            yield None
            return
        replay = router_replay.ReplayCall(self._routers, record=record, num_rows=len(batch),
                                          width=batch["sequences"].shape[1], model_cfg=self.config.model,
                                          groups=self.groups)
        try:
            yield replay
        finally:
            replay.close()

    def finalize_grads(self) -> None:
        """DP average of the grad buffers, SP-norm and tied-embedding all-reduces; once per optimizer step."""
        if not self._grads_finalized:
            finalize_model_grads([self.model], pg_collection=self.groups.pg_collection)
            self._grads_finalized = True

    def optim_step(self) -> dict[str, float]:
        """Finalize, clip, step the optimizer and the LR schedule, zero the grads: ``{"grad_norm", "lr"}``.

        The k-th step (1-based) uses the schedule's LR at k: the first warmup step already moves the weights.
        """
        if self.role == "reference":
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
        return full_state_dict(self.module, self.groups)

    def load_full_state_dict(self, full_sd: Mapping[str, torch.Tensor]) -> None:
        """Load a single-process state dict into this rank's shard; the optimizer's main params follow. A dict
        without LoRA adapters (a base model's) leaves the adapters as they are."""
        load_full_state_dict(self.module, full_sd, self.groups, optional=lora.is_adapter_name)
        follow_new_weights(self.optimizer)

    # ------------------------------------------------------------------ stages

    def _mode(self, training: bool) -> None:
        """Train or eval mode (dropout), set only when it changes: ``Module.train`` walks every submodule (~7 % of
        a tiny model's decoding step when each of a rollout's 17 forwards set it again). Only this class sets it,
        always on the whole model."""
        if self.model.training != training:
            self.model.train(training)

    def plan_call(self, batch: TrainingBatch, *, max_tokens_per_micro_batch: int | None = None) -> CallPlan:
        """Validate, DP-pad, plan, pack on the host and move to the device (model/plan.py); a token budget
        given here replaces ``config.batch``'s micro-batch rule for this call."""
        fixed_shapes = self.groups.pp_size > 1 and not self.module.config.variable_seq_lengths
        config = self.config
        if max_tokens_per_micro_batch is not None:
            config = dataclasses.replace(config, batch=dataclasses.replace(
                config.batch, micro_batch_size=None, max_tokens_per_micro_batch=max_tokens_per_micro_batch))
        return plan_call(
            batch, config, self.groups, align=self.align, pad_token_id=self.pad_token_id,
            fixed_shapes=fixed_shapes, device=self.device, auto_token_budget=self.auto_token_budget,
        )  # fmt: skip

    def _loss_head(self, loss_fn: LossFn, loss_config: Any, compute_entropy: bool,
                   num_microbatches: int, logits_term: schedule.LogitsTerm | None = None) -> schedule.Head:
        return partial(
            schedule.loss_head, **self._head_args(), loss_fn=loss_fn, loss_config=loss_config,
            compute_entropy=compute_entropy, num_microbatches=num_microbatches, logits_term=logits_term,
        )  # fmt: skip

    def _head_args(self) -> dict[str, Any]:
        return {"groups": self.groups, "vocab_size": self.config.model.vocab_size}


@contextlib.contextmanager
def _prepared(term: schedule.LogitsTerm | None, call: CallPlan, groups: ParallelGroups) -> Iterator[None]:
    """``term.prepare`` before the schedule, ``term.close`` after it (also on an error); nothing without a term."""
    if term is None:
        yield
        return
    try:
        term.prepare(call, groups)
        yield
    finally:
        term.close()


def next_token_batch(sequences: torch.Tensor, attention_mask: torch.Tensor,
                     images: tuple[torch.Tensor, torch.Tensor] | None) -> TrainingBatch:
    """The rows of ``next_token_logprobs`` as a ``TrainingBatch`` without responses."""
    n = len(sequences)
    no_responses = torch.zeros((n, 0), dtype=attention_mask.dtype)  # R = 0: validation and DP padding need it
    tensors = {"sequences": sequences, "attention_mask": attention_mask, "response_mask": no_responses}
    if images is not None:
        tensors["pixel_values"], tensors["image_grid_thw"] = images
    return TrainingBatch(tensors, [None] * n, [None] * n, [True] * n)
