"""Call planning: a global ``TrainingBatch`` -> this rank's packed micro-batches, on the host, then the device.

Place in the data flow (docs/DESIGN.md section 1): the first stage of every ``MegatronPolicy`` call, before any
collective. Everything that can fail for a user's input fails here, on every rank (no rank left waiting):

    global batch [B, ...]  (host)                     validate_batch: ValueError naming the key
      | pad_to_multiple(dp_size)                      dummy rows: loss_mask 0 (the one place that pads for DP)
      | plan_microbatches (data/microbatch.py)        every rank computes every DP rank's plan: equal counts
      | this DP rank's micro-batches -> pack (THD)    [1, T] per micro-batch, computed on the host
      | context parallel: split_for_cp               [1, T/cp] local tokens (chunks r, 2cp-1-r of each sequence)
      v
    build_microbatch: one ``.to(device, non_blocking=True)`` per tensor, once per micro-batch

The packs keep Python-int ``max_seqlen``, so nothing inside the model needs ``.item()`` / ``.tolist()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch, dummy_rows
from megatron_rl.data.microbatch import MicroBatchPlan, dp_shard_range, packed_lengths, plan_microbatches
from megatron_rl.data.packing import CPLocalPack, PackedBatch, pack, split_for_cp
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model import token_budget

PER_TOKEN_KEYS = (
    "response_mask", "loss_mask", "rewards", "rollout_logprobs", "old_logprobs", "ref_logprobs",
    "advantages", "returns", "values",
)  # fmt: skip


@dataclass
class MicroBatch:
    rows: list[int]
    """Global row indices of the DP-padded batch; empty for a dummy micro-batch (equal counts across DP)."""
    tensors: dict[str, torch.Tensor]
    """``[b, ...]`` slices of every batch tensor, on the device (one all-masked row for a dummy)."""
    packed: PackedBatch
    """THD pack of ``tensors["sequences"]`` (``[1, T]``, T the call's common length under fixed PP shapes),
    computed on the host; its tensors are on the device, ``max_seqlen`` a Python int. Under context
    parallelism this is still the WHOLE pack (unpacking and labels are global)."""
    cp_local: CPLocalPack | None = None
    """Context parallelism (cp > 1): this CP rank's ``[1, T/cp]`` part of ``packed`` (``split_for_cp``)."""

    @property
    def model_pack(self) -> PackedBatch:
        """What the model of this rank runs on: ``cp_local`` under context parallelism, else ``packed``."""
        return self.cp_local if self.cp_local is not None else self.packed


@dataclass
class CallPlan:
    """One call's view of the batch on this rank."""

    num_rows: int
    """Rows of the caller's batch (before DP padding)."""
    response_width: int
    plan: MicroBatchPlan
    first_row: int
    """First global row of this DP rank's shard."""
    shard_rows: int
    microbatches: list[MicroBatch]
    seq_length: int
    """The largest pack of the call (all DP ranks), per CP rank (``/cp``): the p2p shape when packs are
    extended to one length."""
    num_tokens: int = 0
    """Tokens of the caller's rows (all DP ranks, padding excluded): the MoE z-loss normalizer (model/moe.py)."""


def plan_call(
    batch: TrainingBatch,
    config: MegatronRLConfig,
    groups: ParallelGroups,
    *,
    align: int,
    pad_token_id: int,
    fixed_shapes: bool,
    device: torch.device,
    auto_token_budget: int | None = None,
) -> CallPlan:
    """Validate, DP-pad, plan and pack: everything that can fail happens here, before any collective.

    ``fixed_shapes``: extend every pack to the call's longest (pipeline p2p without variable lengths).
    ``auto_token_budget``: the policy's derived budget, used when ``batch.max_tokens_per_micro_batch`` is
    ``auto`` (model/token_budget.py; raised to the call's longest row).
    """
    batch = batch.to("cpu")  # host planning; a no-op for host batches (the contract)
    validate_batch(batch, config)
    padded, _ = batch.pad_to_multiple(groups.dp_size, pad_token_id)
    lengths = padded["attention_mask"].sum(dim=1).tolist()
    aligned = packed_lengths(lengths, align)
    budget = token_budget.resolve(config.batch.max_tokens_per_micro_batch, auto_token_budget, aligned)
    plans = plan_microbatches(
        lengths, groups.dp_size, micro_batch_size=config.batch.micro_batch_size,
        max_tokens_per_micro_batch=budget, align=align,
    )  # fmt: skip
    seq_length = max(sum(aligned[r] for r in mb) if mb else align for p in plans for mb in p)
    # Workaround W2 (docs/MEGATRON_CORE.md): only without variable_seq_lengths; remove together with W1.
    target = seq_length if fixed_shapes else None
    plan = plans[groups.dp_rank]
    first_row, end_row = dp_shard_range(len(padded), groups.dp_size, groups.dp_rank)
    return CallPlan(
        num_rows=len(batch),
        response_width=batch["response_mask"].shape[1],
        plan=plan,
        first_row=first_row,
        shard_rows=end_row - first_row,
        microbatches=[
            build_microbatch(padded, rows, align=align, pad_token_id=pad_token_id, target_len=target, device=device,
                             cp_size=groups.cp_size, cp_rank=groups.cp_rank)
            for rows in plan
        ],
        seq_length=seq_length // groups.cp_size,
        num_tokens=int(sum(lengths[: len(batch)])),
    )


def with_tokens(call: CallPlan, sequences: torch.Tensor) -> CallPlan:
    """``call``, a plan of one token per row (a decoding step: ``MegatronPolicy.plan_next_tokens``), for the rows'
    next tokens ``sequences`` ``[n, 1]``: the same rows, packs and shapes (they do not depend on the tokens), each
    real row's token put where its pack holds it (its sequence's start); DP-padding rows keep theirs. New
    micro-batch objects: ``call`` stays a template (the KV cache's ``attach`` replaces a micro-batch's pack)."""
    if any(item.cp_local is not None for item in call.microbatches):
        raise ValueError("with_tokens: a plan split for context parallelism (the KV cache does not support CP)")
    microbatches = []
    for item in call.microbatches:
        real = [i for i, r in enumerate(item.rows) if r < call.num_rows]
        if not real:
            microbatches.append(dataclasses.replace(item))
            continue
        packed = item.packed
        tokens = sequences[[item.rows[i] for i in real], 0].to(packed.input_ids.device)
        input_ids = packed.input_ids.clone()
        input_ids[0, packed.cu_seqlens[real]] = tokens  # one token per row: the row's sequence starts there
        rows_tokens = item.tensors["sequences"].clone()
        rows_tokens[real, -1] = tokens.to(rows_tokens.device)
        microbatches.append(dataclasses.replace(item, packed=dataclasses.replace(packed, input_ids=input_ids),
                                                tensors={**item.tensors, "sequences": rows_tokens}))
    return dataclasses.replace(call, microbatches=microbatches)


def build_microbatch(
    padded: TrainingBatch, rows: list[int], *, align: int, pad_token_id: int, target_len: int | None,
    device: torch.device, cp_size: int = 1, cp_rank: int = 0,
) -> MicroBatch:  # fmt: skip
    """Rows ``rows`` of the (host) DP-padded batch, packed (and split for CP) on the host, then moved to
    ``device`` once."""
    if rows:
        index = torch.tensor(rows, dtype=torch.long)
        tensors = {k: v[index] for k, v in padded.tensors.items()}
    else:
        tensors = {k: dummy_rows(k, v, 1, pad_token_id) for k, v in padded.tensors.items()}
    packed = pack(tensors["sequences"], tensors["attention_mask"], align, target_len=target_len)
    local = split_for_cp(packed, cp_size, cp_rank).to(device) if cp_size > 1 else None
    tensors = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
    return MicroBatch(rows=rows, tensors=tensors, packed=packed.to(device), cp_local=local)


def validate_batch(batch: TrainingBatch, config: MegatronRLConfig) -> None:
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
    _validate_tokens(sequences, attention_mask, config)


def _validate_tokens(sequences: torch.Tensor, attention_mask: torch.Tensor, config: MegatronRLConfig) -> None:
    model_cfg = config.model
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
