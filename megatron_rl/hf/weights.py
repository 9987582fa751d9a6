"""Hugging Face safetensors <-> this rank's Megatron GPTModel chunks, under any TP/PP layout (via mbridge).

Place in the data flow: set-up (import: after ``model.builder.build_gpt_model``, before training) and export
(after training, or for a rollout engine). ``model_config_from_hf`` (``hf/config.py``) gives the shapes.

Each checkpoint's family (``hf/families``) moves its tensors: the dense and MoE families through mbridge
(``hf/mbridge.py``: the bridge that speaks our layer names and layout, docs/HF.md section 3), Qwen3.5 through
its own mapping. Here: the checks and the entry points that find the family, the per-stage stream of the weight
sync, and the HF export's writer.

Qwen3.5 (hybrid Gated-DeltaNet) has no mbridge bridge: ``hf/qwen35.py`` maps it (every rank reads the
checkpoint, ``model/weights.py`` shards it); its per-stage stream gathers the stage over TP at once
(``qwen35.StageStream``, which ``bridge_for`` returns for it, ``Family.stage_stream``). Qwen2.5-VL's stream is
mbridge's for the language model plus the vision tower (``qwen2_5_vl.VisionStageStream``).

Export writes ``model.safetensors`` (or size-limited shards + ``model.safetensors.index.json``) on rank 0,
plus the source directory's config and tokenizer files, so ``transformers`` loads the result directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.dist import model_shape_mismatches
from megatron_rl.config import MegatronRLConfig, ModelConfig
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.hf.config import HF_DIR_KEY, describe_hf_load, family_of_checkpoint, load_hf_config, model_config_from_hf
from megatron_rl.hf.mbridge import is_grouped_expert, mbridge_views
from megatron_rl.hf.tokenizer import resolve_pad_token_id
from megatron_rl.model import lora
from megatron_rl.model.optimizer import follow_new_weights
from megatron_rl.model.policy import MegatronPolicy
from megatron_rl.model.weights import unwrap

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth")


def bridge_for(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: ParallelGroups) -> Any:
    """The converter of ``hf_dir``'s family for ``iter_stage_hf_weights`` (``Family.stage_stream``): mbridge's
    (``hf/mbridge.py: stage_bridge``), or the family's own (Qwen3.5: ``qwen35.StageStream``)."""
    hf_config = load_hf_config(hf_dir)
    family = family_of_checkpoint(hf_config)
    return family.stage_stream(model_chunks, hf_dir, groups, model_config_from_hf(hf_dir), hf_config)


def check_hf_matches(model_cfg: ModelConfig, hf_dir: str | os.PathLike, *, key: str = HF_DIR_KEY) -> None:
    """ValueError (naming ``key``, ``hf/config.py: HF_DIR_KEY``) if ``model_cfg`` does not have the shapes of
    the checkpoint in ``hf_dir``."""
    hf_model = model_config_from_hf(hf_dir, key=key)
    diffs = model_shape_mismatches(dataclasses.asdict(hf_model), dataclasses.asdict(model_cfg), "HF config.json")
    diffs += _moe_mismatches(hf_model, model_cfg)
    if diffs:
        raise ValueError(
            f"{key}={str(hf_dir)!r} does not match the model config ({'; '.join(diffs)}); "
            f"build the model from megatron_rl.hf.model_config_from_hf({key})"
        )


_MOE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
               "moe_router_pre_softmax")
"""Fields an MoE model must share with the checkpoint: expert shapes, and the routing (a different router
computes a different model from the same tensors)."""


def _moe_mismatches(hf_model: ModelConfig, model_cfg: ModelConfig) -> list[str]:
    """``"field: HF config.json a vs config b"`` for each ``_MOE_FIELDS`` entry that differs ([] if both dense)."""
    if hf_model.num_moe_experts is None and model_cfg.num_moe_experts is None:
        return []

    def effective(cfg: ModelConfig) -> dict[str, Any]:
        values = {name: getattr(cfg, name) for name in _MOE_FIELDS}
        values["moe_ffn_hidden_size"] = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        return values

    ours, theirs = effective(model_cfg), effective(hf_model)
    return [f"{k}: HF config.json {theirs[k]!r} vs config {ours[k]!r}" for k in _MOE_FIELDS if ours[k] != theirs[k]]


def load_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: ParallelGroups,
                    model_cfg: ModelConfig | None = None, *, key: str = HF_DIR_KEY) -> None:
    """Copy the safetensors of ``hf_dir`` into this rank's bare GPTModel chunks (collective over TP/PP).

    ``model_cfg`` (the ModelConfig the chunks were built from) is checked against ``hf_dir`` first. Errors name
    the directory by ``key`` (``hf/config.py: HF_DIR_KEY``).
    """
    if model_cfg is not None:
        check_hf_matches(model_cfg, hf_dir, key=key)
    if not list(Path(hf_dir).glob("*.safetensors")):
        raise ValueError(f"{key}={str(hf_dir)!r} has no *.safetensors files (only safetensors are read)")
    hf_config = load_hf_config(hf_dir, key=key)
    with torch.no_grad():
        family_of_checkpoint(hf_config).load_weights(model_chunks, hf_dir, groups,
                                                     model_cfg or model_config_from_hf(hf_dir), hf_config)


def load_hf_into_policy(policy: MegatronPolicy, hf_dir: str | os.PathLike | None = None) -> None:
    """Load ``hf_dir`` (default ``config.model.hf_path``) into a ``MegatronPolicy``; refreshes the optimizer's
    main (fp32) copies of the parameters, which were taken when the optimizer was built."""
    key = HF_DIR_KEY if hf_dir is not None else "model.hf_path"
    hf_dir = hf_dir or policy.config.model.hf_path
    if hf_dir is None:
        raise ValueError("model.hf_path is not set; pass the local HF checkpoint directory")
    load_hf_weights([policy.module], hf_dir, policy.groups, policy.config.model, key=key)
    follow_new_weights(policy.optimizer)


def policy_from_hf(config: MegatronRLConfig, groups: ParallelGroups, *, role: Literal["policy", "reference"] = "policy", hf_dir: str | os.PathLike | None = None,
                   pad_token_id: int | None = None, **policy_kwargs: Any) -> MegatronPolicy:
    """A ``MegatronPolicy`` whose shapes (config.json), pad id (tokenizer) and weights come from the local HF
    checkpoint ``hf_dir`` (default ``config.model.hf_path``); the other model fields (dtype, attention backend)
    are kept from ``config.model``. ``pad_token_id`` overrides the tokenizer's (needed when ``hf_dir`` has no
    tokenizer files: ValueError otherwise). Rank 0 prints one line with the values taken from the checkpoint.
    The returned policy's ``config`` holds the HF model section. Collective: call on every rank."""
    key = HF_DIR_KEY if hf_dir is not None else "model.hf_path"  # errors name what the caller set
    hf_dir = hf_dir or config.model.hf_path
    if hf_dir is None:
        raise ValueError("model.hf_path is not set (and no hf_dir= was passed); set it to the local HF "
                         "checkpoint directory")
    config = dataclasses.replace(config, model=model_config_from_hf(hf_dir, base=config.model, key=key))
    pad_id, pad_source = resolve_pad_token_id(hf_dir, pad_token_id, key=key)
    if groups.rank == 0:
        print(describe_hf_load(hf_dir, config.model, pad_id, pad_source), flush=True)
    policy_class = family_of_checkpoint(load_hf_config(hf_dir, key=key)).policy_class() or MegatronPolicy
    policy = policy_class(config, groups, role=role, pad_token_id=pad_id, **policy_kwargs)
    load_hf_into_policy(policy, hf_dir if key == HF_DIR_KEY else None)
    return policy


def iter_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: ParallelGroups,
                    *, merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor on CPU)`` for every HF weight; a collective: run it to the end on every rank.
    ``merge_adapters=False``: a LoRA policy's frozen base alone (the vLLM engines' model, docs/LORA.md section 5)."""
    hf_config = load_hf_config(hf_dir)
    family = family_of_checkpoint(hf_config)
    if not merge_adapters and not family.support.vllm_adapter_sync and lora.adapted_linears(unwrap(model_chunks[0])):
        raise ValueError(f"model.lora.rank > 0 with rollout.engine=vllm is not built for {family.name} models (their "
                         "adapter-only weight sync): use rollout.engine=builtin, or model.lora.rank=0")
    with torch.no_grad():
        yield from family.iter_weights(model_chunks, hf_dir, groups, model_config_from_hf(hf_dir), hf_config,
                                       merge_adapters)


def iter_stage_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: ParallelGroups,
                          *, bridge: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for the weights of *this* pipeline stage only, on the parameters' device.

    Yields on the stage's *stream roots* only: TP rank 0 ranks whose expert-parallel rank is 0 (every TP rank 0
    of a dense model; the weight-sync sender, tp = dp = cp = 0, is one). The other ranks send their pieces to
    their root and yield nothing, but must still run this to the end (collective over the TP and EP groups):
    TP ranks > 0 their TP shards (gathered per tensor), EP ranks > 0 their experts (``_stream_experts``: one
    expert tensor at a time, point to point). Nothing crosses pipeline stages (unlike ``iter_hf_weights``).
    Names, order, dtypes and values are those of mbridge's export (``iter_hf_weights``): a fused QKV or gated
    fc1 yields several; local expert j yields global experts ``j, n_local + j, 2 n_local + j, ...`` (EP rank
    order); the last stage's copy of a tied output layer is skipped (the first stage yields
    ``model.embed_tokens.weight``); vocabulary padding rows are dropped. Used by the weight sync into a rollout
    engine (``megatron_rl/inference/vllm/weight_sync.py``), which passes ``bridge`` (``bridge_for`` of the same
    chunks, built once) so that a sync reads no config file and runs no extra collective.

    Extra memory on a root, per parameter of TP > 1 (``_gather_on_first``): one buffer of the full tensor,
    received in place, which *is* mbridge's merged tensor for a dim-0 split (embedding, output layer, QKV,
    plain or gated fc1: the yielded tensors are views of it); QKV's q/k/v are then copied one at a time (as
    mbridge's own split copies them); a row-parallel weight (split along dim 1: linear_proj, fc2) costs one
    more copy, the concatenation along dim 1 (2x a tensor far smaller than the embedding). Under EP one
    received expert tensor at a time. Nothing else is kept: a yielded tensor lives as long as the caller holds it.
    Experts split over an expert-TP group (``expert_tensor_parallel_size`` > 1) are refused with a ValueError.
    """
    if groups.etp_size > 1:
        raise ValueError(f"parallel.expert_tensor_parallel_size={groups.etp_size}: the per-stage weight stream "
                         "handles whole experts only; set expert_tensor_parallel_size=1")
    if bridge is None:
        bridge = bridge_for(model_chunks, hf_dir, groups)
    from mbridge.core.bridge import Bridge

    if hasattr(bridge, "language"):  # a language bridge and the stage's other tensors (Qwen2.5-VL: its vision tower)
        yield from iter_stage_hf_weights(bridge.language_chunks(model_chunks), hf_dir, groups, bridge=bridge.language)
        with torch.no_grad():
            yield from bridge.extra_stage_weights(model_chunks, groups)
        return
    if not isinstance(bridge, Bridge):  # a family's own stream (Qwen3.5: the stage gathered at once)
        with torch.no_grad():
            yield from bridge.iter_stage_weights(model_chunks, groups)
        return
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    root = _is_stream_root(groups)
    with torch.no_grad():
        for view in mbridge_views(model_chunks, merge_adapters=True):
            local_to_global = bridge._weight_name_mapping_mcore_local_to_global(view, consider_ep=False)
            for local_name, param in view.named_parameters():
                if tied and local_name == "output_layer.weight":
                    continue
                name = local_to_global[local_name]
                if is_grouped_expert(name):  # whole on this rank (expert TP 1): only EP to cross
                    yield from _stream_experts(bridge, name, param.detach(), groups)
                elif getattr(param, "tensor_model_parallel", False) and groups.tp_size > 1:
                    plan = _merge_plan(bridge, name, param)
                    pieces = 2 if plan == "gated" else 1
                    if root:  # the buffer is passed on unnamed, so that the merge can free it
                        yield from _merged_to_hf(bridge, name, param, plan,
                                                 _gather_on_first(param.detach(), groups, pieces))
                    elif groups.tp_rank == 0:  # EP rank > 0 (possible when ep > tp): its TP ranks send anyway
                        _gather_on_first(param.detach(), groups, pieces)
                    else:
                        _send_to_first(param.detach(), groups, pieces)
                elif root:
                    yield from _to_hf(bridge, name, param.detach())


def _is_stream_root(groups: ParallelGroups) -> bool:
    """Whether this rank yields its stage's stream in ``iter_stage_hf_weights``: TP rank 0 and EP rank 0."""
    return groups.tp_rank == 0 and groups.ep_rank == 0


def _ep_root_streams(groups: ParallelGroups) -> bool:
    """Whether rank 0 of this rank's EP group is a stream root, i.e. its TP rank is 0. megatron-core orders
    ranks tp-cp-ep-dp-pp (TP fastest), so a global rank's TP rank is ``rank % tp_size``; no collective."""
    assert groups.tp_rank == groups.rank % groups.tp_size, "megatron-core's rank order (TP fastest) changed"
    return dist.get_global_rank(groups.ep_group, 0) % groups.tp_size == 0


def _stream_experts(bridge: Any, name: str, param: torch.Tensor, groups: ParallelGroups
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Local expert ``j``'s parameter (``name`` = ``...linear_fcX.weight{j}``, global, ``consider_ep=False``) of
    every EP rank of this rank's EP group, in HF form, on the EP group's rank 0 if it is a stream root: its own
    copy, then EP rank r's (global expert ``r * n_local + j``) received into one fresh buffer, converted and
    yielded before the next is received. The other EP ranks send theirs; EP groups whose rank 0 is not a root
    (its TP rank > 0) move nothing. mbridge's ``export_weights`` instead all-gathers all EP ranks' copies on
    every rank."""
    if groups.ep_size == 1:
        if _is_stream_root(groups):
            yield from _to_hf(bridge, name, param)
        return
    if not _ep_root_streams(groups):
        return
    if groups.ep_rank > 0:
        dist.send(param.contiguous(), group=groups.ep_group, group_dst=0)
        return
    prefix, local = name.rsplit(".weight", 1)
    per_rank = bridge.config.num_moe_experts // groups.ep_size
    for ep_rank in range(groups.ep_size):
        if ep_rank == 0:
            tensor = param
        else:
            tensor = torch.empty_like(param)
            dist.recv(tensor, group=groups.ep_group, group_src=ep_rank)
        yield from _to_hf(bridge, f"{prefix}.weight{ep_rank * per_rank + int(local)}", tensor)
        del tensor


def _merge_plan(bridge: Any, name: str, param: torch.Tensor) -> str:
    """How mbridge's ``Bridge._weight_merge_across_tp`` merges ``name``: ``rows`` (a concatenation along dim 0),
    ``gated`` (fc1 of a gated MLP: each rank's ``[gate_r; up_r]`` -> ``[gate_0; gate_1; ...; up_0; up_1; ...]``),
    ``cols`` (a concatenation along dim 1) or ``mbridge`` (anything else, or a bridge that overrides the merge
    or the HF conversion: its own methods on a merged copy)."""
    if not _mbridge_base_conversion(bridge):  # (experts never come here: _stream_experts)
        return "mbridge"
    if _is_fc1(name):
        return "gated" if bridge._get_mcore_config_by_name(name).gated_linear_unit else "rows"
    if _is_qkv(name) or param.partition_dim == 0:
        return "rows"
    return "cols" if param.partition_dim == 1 else "mbridge"


def _send_to_first(shard: torch.Tensor, groups: ParallelGroups, pieces: int) -> None:
    """A TP rank > 0's part of ``_gather_on_first``: its shard, in ``pieces`` row blocks, to TP rank 0."""
    for i, piece in enumerate(shard.contiguous().chunk(pieces)):
        if piece.is_cuda:
            dist.gather(piece, None, group=groups.tp_group, group_dst=0)
        else:
            dist.send(piece, group=groups.tp_group, group_dst=0, tag=i)


def _gather_on_first(shard: torch.Tensor, groups: ParallelGroups, pieces: int) -> torch.Tensor:
    """On TP rank 0: the stage's TP shards of one parameter in ONE new tensor ``[pieces, tp, rows / pieces, ...]``
    (block ``p`` of rank ``r``'s shard at ``[p, r]``), written in place by the transport.

    Gloo's ``gather`` and ``all_gather_into_tensor`` stage the whole result in a temporary of their own
    (measured with torch 2.13: 2x the tensor on the receiver), so on CPU the blocks come as point-to-point
    messages received straight into the buffer; NCCL's ``gather`` writes into the given views directly.
    """
    tp = groups.tp_size
    blocks = shard.contiguous().chunk(pieces)
    gathered = torch.empty((pieces, tp, *blocks[0].shape), dtype=shard.dtype, device=shard.device)
    for p, block in enumerate(blocks):
        if block.is_cuda:
            dist.gather(block, list(gathered[p].unbind(0)), group=groups.tp_group, group_dst=0)
        else:
            works = [dist.irecv(gathered[p, r], group=groups.tp_group, group_src=r, tag=p) for r in range(1, tp)]
            gathered[p, 0].copy_(block)
            for work in works:
                work.wait()
    return gathered


def _merged_to_hf(bridge: Any, name: str, param: torch.Tensor, plan: str, gathered: torch.Tensor
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of one TP-split parameter from ``_gather_on_first``'s buffer: bitwise what mbridge's
    ``_weight_merge_across_tp`` then ``_weight_to_hf_format`` give, without the merge's full copy for the
    ``rows`` and ``gated`` plans (the buffer, viewed as ``[tp * rows, ...]``, is already the merged tensor)."""
    block_shape = gathered.shape[3:]
    if plan in ("rows", "gated"):
        full = gathered.view(-1, *block_shape)
    elif plan == "cols":
        full = torch.cat(gathered[0].unbind(0), dim=1)  # row-parallel: one extra copy
    else:
        full = bridge._weight_merge_across_tp(name, list(gathered[0].unbind(0)), param)
    del gathered
    yield from _to_hf(bridge, name, full)


def _to_hf(bridge: Any, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """mbridge's ``_weight_to_hf_format`` of a merged tensor, QKV's q/k/v made one at a time (mbridge makes the
    three copies together)."""
    if not (_is_qkv(name) and _mbridge_base_conversion(bridge)):
        hf_names, hf_tensors = bridge._weight_to_hf_format(name, full)
        del full
        yield from zip(hf_names, hf_tensors)
        return
    hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
    assert len(hf_names) == 3, (name, hf_names)
    # Same arithmetic as mbridge's ``Bridge._weight_to_hf_format`` (so the same values and layouts).
    cfg = bridge.hf_config
    hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", hidden // heads)
    bias = ".bias" in name
    qkv = full.view(*([kv_heads, -1] if bias else [kv_heads, -1, hidden]))
    del full
    q_len = head_dim * heads // kv_heads
    bounds = [(0, q_len), (q_len, q_len + head_dim), (q_len + head_dim, None)]
    for hf_name, (start, stop) in zip(hf_names, bounds):
        yield hf_name, qkv[:, start:stop].reshape(*([-1] if bias else [-1, hidden]))


def _is_qkv(name: str) -> bool:
    return "self_attention.linear_qkv." in name and "layer_norm" not in name


def _is_fc1(name: str) -> bool:
    return "linear_fc1.weight" in name or "linear_fc1.bias" in name


def _mbridge_base_conversion(bridge: Any) -> bool:
    """True when the bridge uses mbridge's own ``Bridge`` merge and HF conversion (which the shortcuts above
    reproduce); a model bridge that overrides either gets its own methods on the full merged tensor."""
    from mbridge.core.bridge import Bridge

    cls = type(bridge)
    return (cls._weight_to_hf_format is Bridge._weight_to_hf_format
            and cls._weight_merge_across_tp is Bridge._weight_merge_across_tp)


def export_hf(model_chunks: list[torch.nn.Module], out_dir: str | os.PathLike, hf_dir: str | os.PathLike,
              groups: ParallelGroups, *, max_shard_bytes: int = 5 << 30, merge_adapters: bool = True) -> Path:
    """Write the model as a Hugging Face checkpoint in ``out_dir`` (rank 0 writes; collective).

    ``hf_dir`` is the checkpoint the model came from: its config and tokenizer files are copied. LoRA adapters
    are merged into their linears, unless ``merge_adapters=False`` (the frozen base alone).
    """
    out_dir = Path(out_dir)
    if Path(hf_dir).resolve() == out_dir.resolve():
        raise ValueError(f"export directory {str(out_dir)!r} is the source hf_path; choose another directory")
    writer = _ShardWriter(out_dir, max_shard_bytes) if dist.get_rank() == 0 else None
    for name, tensor in iter_hf_weights(model_chunks, hf_dir, groups, merge_adapters=merge_adapters):
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        _copy_side_files(Path(hf_dir), out_dir)
    dist.barrier()
    return out_dir


def export_policy_to_hf(policy: MegatronPolicy, out_dir: str | os.PathLike, hf_dir: str | os.PathLike | None = None) -> Path:
    """``export_hf`` of a ``MegatronPolicy`` (source directory default ``config.model.hf_path``). A LoRA policy
    exports the merged model, and its adapters as a peft adapter in ``out_dir/adapter`` (``hf/lora.py``)."""
    hf_dir = hf_dir or policy.config.model.hf_path
    if hf_dir is None:
        raise ValueError("export needs the source HF directory (config/tokenizer): set model.hf_path")
    out_dir = export_hf([policy.module], out_dir, hf_dir, policy.groups)
    lora_cfg = policy.config.model.lora
    if lora_cfg.enabled:  # the merged model above; the adapter alone beside it (hf/lora.py)
        from megatron_rl.hf.lora import ADAPTER_DIR, export_peft_adapter

        export_peft_adapter(policy.module, lora_cfg, out_dir / ADAPTER_DIR, policy.groups, base_model=str(hf_dir))
    return out_dir


class _ShardWriter:
    """Accumulates tensors and writes safetensors shards of at most ``max_bytes`` (one file if it fits)."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("model*.safetensors*"):
            old.unlink()
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in f for f in self.files):
            return  # tied embedding exported from both ends of the pipeline: the same tensor
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.out_dir / f".shard{len(self.files)}.tmp"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, final in enumerate(names):
            os.replace(self.out_dir / f".shard{i}.tmp", self.out_dir / final)
        if count > 1:
            weight_map = {t: names[i] for i, tensors in enumerate(self.files) for t in tensors}
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, generation config and tokenizer files of the source checkpoint (everything but weights)."""
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
