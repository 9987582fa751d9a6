"""Save and resume a training run with megatron-core ``dist_checkpointing``, atomically.

Place in the data flow: after an optimizer step (docs/DESIGN.md section 1, "checkpoint"), and once at start-up to
resume. Callers use ``save_checkpoint(policy, ...)`` / ``load_checkpoint(policy, ...)``; ``policy`` is any
``CheckpointablePolicy`` (``MegatronPolicy`` is one; the model package does not import this one).

A checkpoint holds (layout: ``checkpoint/layout.py``):
- the model chunks' sharded state (``GPTModel.sharded_state_dict``: global layer numbers, TP shards), so it
  loads under any TP/PP/DP layout;
- the optimizer (``optimizer_state.py``: the distributed optimizer as ``fully_reshardable``, and the 0.16.1
  fixes), the LR scheduler (without it the LR is wrong after the first resumed step), per-rank RNG states;
- the trainer state (``step``, consumed prompts, data position: a JSON-serializable dict) and the resolved
  ``MegatronRLConfig``.

Save (every rank calls it; collective):

    tmp dir (rank 0 creates it, after removing crashed saves)  -> fault point tmp_created
    dist_checkpointing.save, RNG per rank, trainer state/config -> fault point shards_written
    CRC32 + fsync of every file (strided over ranks), manifest  -> fault point manifest_written
    rename to step_<n> (rank 0), fsync parent                  -> fault point renamed
    replace `latest` (rank 0)                                   -> fault point latest_written
    prune to checkpoint.keep_last

under a deadline (``checkpoint.save_timeout_s``, SIGALRM in the main thread: a hung writer process raises
TimeoutError here instead of hanging; a hung collective is left to the process-group timeout).

Load: rank 0 resolves the directory (``latest``, else the newest complete one) and every rank uses its
answer; the manifest, the model shape and the optimizer kind are checked and the files verified against the
manifest (sizes and CRC32, strided over ranks) *before* anything is read into the model, so a missing,
corrupt or mismatched checkpoint raises ValueError on every rank and overwrites nothing. Resuming from a
save_dir with ``checkpoint.resume_fallback`` (the default): a newest checkpoint that fails verification (a
flipped or truncated shard, a damaged ``common.pt``, ``.metadata``, RNG file, trainer state or manifest) is
skipped with one warning naming it and the failure, and renamed ``.corrupt.step_N`` once an older one
verifies; a damaged ``latest`` pointer falls back to scanning the ``step_*`` directories.

A save that hits a full disk or a read-only filesystem (ENOSPC, EDQUOT, EROFS, EACCES) raises one
RuntimeError on every rank naming the directory and the previous checkpoint, which stays intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import queue
import signal
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.checkpoint import layout, lora as lora_checkpoint
from megatron_rl.checkpoint.optimizer_state import (
    load_optimizer_state,
    optimizer_kind,
    optimizer_layout,
    sharded_optimizer_state,
)
from megatron_rl.checkpoint.rng import capture_rng_state, restore_rng_state
from megatron_rl.config import MegatronRLConfig, dump_config
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model.optimizer import follow_new_weights

T = TypeVar("T")
TrainerState = dict[str, Any]
"""JSON-serializable trainer state (``step``: int, plus whatever the caller keeps); values are JSON."""
ModelDict = dict[str, Any]
"""A ``ModelConfig`` as a dict (``config_to_dict``): field name -> JSON value."""


class CheckpointablePolicy(Protocol):
    """What a checkpoint needs of a policy (``MegatronPolicy`` has it)."""

    module: torch.nn.Module
    """The bare GPTModel chunk of this rank."""
    optimizer: MegatronOptimizer | None
    scheduler: OptimizerParamScheduler | None
    config: MegatronRLConfig
    groups: ParallelGroups


HYBRID_FIELDS = ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")
"""The Gated-DeltaNet shape fields (docs/QWEN35.md); they mean nothing while linear_attention_freq is None."""

SHAPE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "vocab_size", "share_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm", "num_moe_experts",
    "moe_ffn_hidden_size", "attention_output_gate", *HYBRID_FIELDS,
)  # fmt: skip
"""ModelConfig fields that must match between a checkpoint and the model it is loaded into."""


SOFT_FIELDS = (
    "rotary_base", "layernorm_epsilon", "params_dtype", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "rotary_percent", "layernorm_zero_centered_gamma",
)  # fmt: skip
"""ModelConfig fields that load under another value but change the model's function: a warning."""


def model_shape_mismatches(source: ModelDict, current: ModelDict, source_name: str) -> list[str]:
    """``"field: <source_name> a vs config b"`` for every SHAPE_FIELDS entry that differs (ModelConfig dicts)."""
    source, current = _effective_shape(source), _effective_shape(current)
    return [
        f"{k}: {source_name} {source.get(k)!r} vs config {current.get(k)!r}"
        for k in SHAPE_FIELDS
        if source.get(k) != current.get(k)
    ]


def _effective_shape(model: ModelDict) -> ModelDict:
    """kv_channels=None means hidden_size // num_attention_heads, moe_ffn_hidden_size=None of an MoE model
    ffn_hidden_size (ModelConfig); manifests written before MoE have no MoE fields (a dense model)."""
    model = dict(model)
    if model.get("kv_channels") is None and model.get("num_attention_heads"):
        model["kv_channels"] = model["hidden_size"] // model["num_attention_heads"]
    if model.get("num_moe_experts") is not None and model.get("moe_ffn_hidden_size") is None:
        model["moe_ffn_hidden_size"] = model.get("ffn_hidden_size")
    model.setdefault("attention_output_gate", False)  # manifests written before Qwen3.5: no gate
    if model.get("linear_attention_freq") is None:  # a plain transformer (or a manifest before Qwen3.5)
        model.update(dict.fromkeys(HYBRID_FIELDS))
    return model


@dataclasses.dataclass
class CheckpointParts:
    """What a checkpoint captures of a trainable (or frozen) model on this rank."""

    model_chunks: list[torch.nn.Module]
    """Bare GPTModel chunks of this rank (never the DDP wrapper: it prefixes keys with ``module.``)."""
    optimizer: MegatronOptimizer | None
    """Megatron optimizer (``get_megatron_optimizer``), None for a frozen model."""
    scheduler: OptimizerParamScheduler | None
    """``OptimizerParamScheduler``, None for a frozen model."""
    config: MegatronRLConfig
    groups: ParallelGroups
    """This rank's process groups."""


def parts_of(policy: CheckpointablePolicy) -> CheckpointParts:
    """The checkpointed parts of a ``MegatronPolicy`` (one model chunk per PP stage)."""
    return CheckpointParts([policy.module], policy.optimizer, policy.scheduler, policy.config, policy.groups)


def save_checkpoint(policy: CheckpointablePolicy, save_dir: str | Path, trainer_state: TrainerState) -> Path:
    """Save ``policy`` and ``trainer_state`` (needs an int ``step``) under ``save_dir``; returns the
    checkpoint directory. Keeps ``config.checkpoint.keep_last`` checkpoints, aborts after
    ``config.checkpoint.save_timeout_s``. Collective: every rank calls it."""
    ckpt_cfg = policy.config.checkpoint
    return save_parts(
        parts_of(policy), save_dir, trainer_state, keep_last=ckpt_cfg.keep_last, timeout_s=ckpt_cfg.save_timeout_s
    )


def load_checkpoint(
    policy: CheckpointablePolicy,
    path: str | Path,
    *,
    load_optimizer: bool = True,
    verify_checksums: bool = True,
    fallback: bool | None = None,
) -> TrainerState:
    """Restore ``policy`` from ``path`` (a checkpoint directory, or a save_dir: its latest complete
    checkpoint); returns the trainer state. ``verify_checksums=False`` checks file sizes only (reading a very
    large checkpoint twice costs time). ``fallback`` (default ``config.checkpoint.resume_fallback``): a save_dir
    whose newest checkpoint fails verification resumes from the newest one that verifies (module docstring).
    Collective."""
    load_optimizer = load_optimizer and policy.optimizer is not None  # a frozen model has none to load
    if fallback is None:
        fallback = policy.config.checkpoint.resume_fallback
    return load_parts(parts_of(policy), path, load_optimizer=load_optimizer, verify_checksums=verify_checksums,
                      fallback=fallback)


# ---------------------------------------------------------------------------------------------- save


# Workaround W31 (docs/MEGATRON_CORE.md; megatron-core 0.16.1 and 0.19.2): remove when megatron-core's writer queue
# is no process of its own (tests/checkpoint/test_ckpt_writer_queue.py; tests/job/test_vllm_main_job.py checks
# that nothing survives a SIGKILL of the job).
def writer_queue_in_process() -> None:
    """Give megatron-core's checkpoint writer an in-process results queue instead of a ``multiprocessing.Manager()``.

    ``dist_checkpointing.strategies.filesystem_async.get_write_results_queue`` creates, at the first save, a
    spawned ``Manager()`` server process and keeps it for the life of the rank: it did not watch its parent (a
    SIGKILL of the rank left it running forever) and it cost ~4 CPU s per saving rank of every run (it unpickles
    the write results, which imports torch). megatron_rl saves synchronously (``dist_checkpointing.save`` ->
    ``AsyncRequest.execute_sync``): the writer function runs in the rank itself, puts its results in the queue
    and ``retrieve_write_results`` takes them out in the same process (0.19.2 writes with threads, 0.16.1 with
    forked processes that report on a queue of their own), so a ``queue.Queue`` carries them just as well and
    no process is started. An asynchronous save (the writer in another process) would need the manager back."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is None:  # not made yet (and this version has it)
        filesystem_async._results_queue = queue.Queue()


def save_parts(
    parts: CheckpointParts,
    save_dir: str | Path,
    trainer_state: TrainerState,
    *,
    keep_last: int = 2,
    timeout_s: float | None = None,
) -> Path:
    """Atomic save of ``parts`` (module docstring); returns ``save_dir/step_<step>``."""

    save_dir, step = Path(save_dir), _step_of(trainer_state)
    state_json = _trainer_state_json(trainer_state)
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={keep_last} must be >= 1")
    with _deadline(timeout_s, f"saving checkpoint step {step} to {save_dir}"), _storage_errors(save_dir, step):
        tmp = _make_tmp_dir(save_dir, step)
        layout.fault_point("tmp_created")
        writer_queue_in_process()
        dist_checkpointing.save(_sharded_state(parts, is_loading=False), str(tmp))
        _write_side_files(tmp, parts, state_json)
        layout.fault_point("shards_written")
        _write_manifest(tmp, parts, step, lora_checkpoint.manifest_entries(parts.model_chunks, parts.config,
                                                                           parts.groups))
        layout.fault_point("manifest_written")
        final = save_dir / layout.checkpoint_name(step)
        _publish(save_dir, tmp, final, keep_last)
    return final


def _make_tmp_dir(save_dir: Path, step: int) -> Path:
    tmp = layout.tmp_dir_for(save_dir, step)

    def make() -> None:
        save_dir.mkdir(parents=True, exist_ok=True)
        layout.clear_stale_tmp(save_dir)
        tmp.mkdir()  # empty: megatron warns "Overwriting old incomplete" when saving into a non-empty one

    _together(make, rank0_only=True)
    return tmp


def _write_side_files(tmp: Path, parts: CheckpointParts, state_json: str) -> None:
    _together(lambda: (tmp / layout.RNG_DIR).mkdir(), rank0_only=True)

    def write() -> None:
        torch.save(capture_rng_state(), tmp / layout.RNG_DIR / f"rank_{dist.get_rank():05d}.pt")
        if dist.get_rank() == 0:
            (tmp / layout.TRAINER_STATE_FILE).write_text(state_json)
            dump_config(parts.config, tmp / layout.CONFIG_FILE)

    _together(write)


def _write_manifest(tmp: Path, parts: CheckpointParts, step: int, extra: dict[str, Any]) -> None:
    """CRC32 + fsync of every file, split over ranks; rank 0 writes the manifest (plus ``extra``: a LoRA run's
    base fingerprint)."""
    names = _broadcast_from_rank0(lambda: layout.list_files(tmp))
    mine = _together(lambda: {n: layout.file_record(tmp / n) for n in names[dist.get_rank() :: dist.get_world_size()]})
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)

    def write() -> None:
        records = {name: rec for part in gathered for name, rec in part.items()}
        assert sorted(records) == names, "every file checksummed exactly once"
        layout.write_manifest(tmp, records, {**_manifest_info(parts, step), **extra})

    _together(write, rank0_only=True)


def _manifest_info(parts: CheckpointParts, step: int) -> dict[str, Any]:
    g = parts.groups
    return {
        "step": step,
        "layout": _parallel_layout(parts.groups),
        "model": dataclasses.asdict(parts.config.model),
        "optimizer_kind": optimizer_kind(parts.optimizer),
        "optimizer_layout": optimizer_layout(parts.optimizer),
        "optimizer": parts.config.optimizer.optimizer if parts.optimizer is not None else None,
        "has_scheduler": parts.scheduler is not None,
        "num_model_chunks": len(parts.model_chunks),
        "megatron_core": _mcore_version(),
    }


def _parallel_layout(g: ParallelGroups) -> dict[str, int]:
    """The parallel sizes a checkpoint was saved under (the manifest's ``layout``); ``ep`` only for expert
    parallelism, so dense checkpoints keep the layout they always had."""
    sizes = {"world_size": g.world_size, "tp": g.tp_size, "pp": g.pp_size, "dp": g.dp_size, "cp": g.cp_size}
    return {**sizes, "ep": g.ep_size} if g.ep_size > 1 else sizes


def _mcore_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _publish(save_dir: Path, tmp: Path, final: Path, keep_last: int) -> None:
    _together(lambda: layout.publish(tmp, final), rank0_only=True)
    layout.fault_point("renamed")
    _together(lambda: layout.write_latest(save_dir, final), rank0_only=True)
    layout.fault_point("latest_written")
    _together(lambda: layout.prune(save_dir, keep_last), rank0_only=True)


# ---------------------------------------------------------------------------------------------- load


def load_parts(
    parts: CheckpointParts,
    path: str | Path,
    *,
    load_optimizer: bool = True,
    verify_checksums: bool = True,
    fallback: bool = False,
) -> TrainerState:
    """Restore ``parts`` from ``path``; returns the trainer state (module docstring for the checks)."""

    ckpt, manifest = _choose_checkpoint(Path(path), verify_checksums, fallback)
    _check_compatible(manifest, parts, load_optimizer, ckpt)
    template_parts = parts if load_optimizer else dataclasses.replace(parts, optimizer=None, scheduler=None)
    loaded = dist_checkpointing.load(_sharded_state(template_parts, is_loading=True), str(ckpt))
    for key, chunk in _chunk_keys(parts.model_chunks):
        if parts.config.model.lora.enabled:  # the adapters only; the base came from model.hf_path
            lora_checkpoint.load_model_state(chunk, loaded[key])
        else:
            chunk.load_state_dict(loaded[key], strict=True)
    if load_optimizer and parts.optimizer is not None:
        load_optimizer_state(parts.optimizer, loaded["optimizer"], manifest.get("optimizer_layout"))
    else:  # weights only: the optimizer's fp32 main copies (bf16) must follow them
        follow_new_weights(parts.optimizer)
    if load_optimizer and parts.scheduler is not None:
        parts.scheduler.load_state_dict(loaded["scheduler"])
    _restore_rng(ckpt, manifest, parts)
    return json.loads((ckpt / layout.TRAINER_STATE_FILE).read_text())


def _check_compatible(manifest: dict, parts: CheckpointParts, load_optimizer: bool, ckpt: Path) -> None:
    """ValueError (same on every rank: the manifest came from rank 0) for a checkpoint of another model or
    optimizer; warning for a different non-shape model setting."""
    written_by, installed = manifest.get("megatron_core"), _mcore_version()
    if written_by is not None and _version_key(written_by) > _version_key(installed):
        # 0.17+ writes no common.pt, which 0.16.x's dist_checkpointing needs (it fails with an AttributeError).
        raise ValueError(
            f"checkpoint {ckpt} was written with megatron-core {written_by}, newer than the installed {installed}; "
            f"load it with megatron-core >= {written_by} (Python >= 3.12: bash scripts/setup.sh)"
        )
    saved, current = manifest["model"], dataclasses.asdict(parts.config.model)
    diffs = model_shape_mismatches(saved, current, "checkpoint")
    if diffs:
        raise ValueError(f"checkpoint {ckpt} holds a different model ({'; '.join(diffs)}); fix model.* or the path")
    soft = [k for k in SOFT_FIELDS if saved.get(k, current[k]) != current[k]]
    if soft:
        warnings.warn(f"checkpoint {ckpt}: model settings differ from the config: {soft} (loading anyway)")
    lora_checkpoint.check_compatible(manifest, parts.model_chunks, parts.config, parts.groups, ckpt)
    if manifest.get("num_model_chunks") != len(parts.model_chunks):
        raise ValueError(f"checkpoint {ckpt} has {manifest.get('num_model_chunks')} model chunks per rank, "
                         f"this model {len(parts.model_chunks)}; virtual pipeline sizes must match")
    if not load_optimizer or parts.optimizer is None:
        return
    kind, saved_kind = optimizer_kind(parts.optimizer), manifest.get("optimizer_kind")
    if saved_kind is None:
        raise ValueError(f"checkpoint {ckpt} has no optimizer state; load it with load_optimizer=False")
    if (kind, parts.config.optimizer.optimizer) != (saved_kind, manifest.get("optimizer")):
        raise ValueError(
            f"checkpoint {ckpt} holds a {saved_kind} {manifest.get('optimizer')} optimizer, this run uses a {kind} "
            f"{parts.config.optimizer.optimizer} one; match optimizer.use_distributed_optimizer / "
            "optimizer.optimizer to the checkpoint, or load with load_optimizer=False"
        )


def _choose_checkpoint(path: Path, checksums: bool, fallback: bool) -> tuple[Path, dict]:
    """The checkpoint to load and its manifest: the first of ``layout.resume_candidates`` that verifies.

    Every rank walks the same candidates (listed on rank 0) and reaches the same verdict on each (manifest
    from rank 0, file problems all-gathered), so no rank can pick another checkpoint. Strict (``fallback``
    False, or ``path`` is one checkpoint directory): the first failure is the error. With fallback, the
    failed newer ones are moved aside with one warning each once an older one verifies; when none does,
    one ValueError lists each and why (nothing is moved).
    """
    candidates = _broadcast_from_rank0(lambda: [str(p) for p in layout.resume_candidates(path, fallback)])
    strict = not fallback or (path / layout.MANIFEST_FILE).is_file()
    failed: list[tuple[Path, list[str]]] = []
    for ckpt in map(Path, candidates):
        manifest, why = _broadcast_from_rank0(lambda: layout.manifest_or_problem(ckpt))
        if manifest is not None:
            problems = _file_problems(ckpt, manifest, checksums)
            if not problems:
                _move_aside(failed)
                return ckpt, manifest
            why = f"checkpoint {ckpt} is corrupt: {'; '.join(problems[:5])}"
        if strict:
            hint = "" if manifest is None else "; use an older checkpoint (checkpoint.resume_fallback=true finds one)"
            raise ValueError(why + hint)
        failed.append((ckpt, why))
    listed = "; ".join(f"{ckpt.name}: {why}" for ckpt, why in failed)
    raise ValueError(f"no complete checkpoint in {str(path)!r} verifies ({listed}); restore one from a backup, or "
                     "move the save_dir aside (or set checkpoint.resume=false) to start from scratch")


def _file_problems(ckpt: Path, manifest: dict, checksums: bool) -> list[str]:
    """Missing, truncated or changed files of ``ckpt`` (checked strided over ranks; the same list on all)."""
    names = sorted(manifest["files"])
    mine = layout.verify_files(ckpt, manifest, names[dist.get_rank() :: dist.get_world_size()], checksums)
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return [p for part in gathered for p in part]


def _move_aside(failed: list[tuple[Path, str]]) -> None:
    """Rank 0 renames each checkpoint that failed verification (never deletes it) and warns once for each."""
    if dist.get_rank() != 0:
        return
    for ckpt, why in failed:
        outcome = layout.move_aside(ckpt)
        warnings.warn(f"skipping checkpoint {ckpt} on resume: {why}; {outcome}", stacklevel=4)


def _restore_rng(ckpt: Path, manifest: dict, parts: CheckpointParts) -> None:
    if manifest["layout"] != _parallel_layout(parts.groups):
        if dist.get_rank() == 0:
            warnings.warn(f"checkpoint {ckpt} was saved under layout {manifest['layout']}: RNG states not restored")
        return
    path = ckpt / layout.RNG_DIR / f"rank_{dist.get_rank():05d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file, verified against the manifest
    restore_rng_state(state)


# ---------------------------------------------------------------------------------------------- helpers


def _chunk_keys(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """Megatron-LM's key convention: 'model' for one chunk, 'model0', 'model1', ... for virtual stages."""
    if len(chunks) == 1:
        return [("model", chunks[0])]
    return [(f"model{i}", chunk) for i, chunk in enumerate(chunks)]


def _sharded_state(parts: CheckpointParts, is_loading: bool) -> dict[str, Any]:
    lora = parts.config.model.lora.enabled  # a LoRA run saves its adapters, not the frozen base
    state: dict[str, Any] = {
        key: lora_checkpoint.model_sharded_state(chunk, parts.groups) if lora else chunk.sharded_state_dict()
        for key, chunk in _chunk_keys(parts.model_chunks)
    }
    if parts.optimizer is not None:
        model_state = dict(state)
        state["optimizer"] = sharded_optimizer_state(parts.optimizer, model_state, is_loading)
    if parts.scheduler is not None:
        state["scheduler"] = parts.scheduler.state_dict()
    return state


def _step_of(trainer_state: TrainerState) -> int:
    step = trainer_state.get("step") if isinstance(trainer_state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"trainer_state['step']={step!r} must be an int >= 0 (the train step being saved)")
    return step


def _trainer_state_json(trainer_state: TrainerState) -> str:
    try:
        return json.dumps(trainer_state, indent=1, sort_keys=True)
    except TypeError as err:
        raise ValueError(f"trainer_state must be JSON-serializable (ints, floats, strings, lists, dicts): {err}") from err


def _together(fn: Callable[[], T], *, rank0_only: bool = False) -> T | None:
    """Run ``fn`` (on every rank, or on rank 0 only) and raise on every rank if it raised on any.

    The filesystem steps of a save run on some ranks only; a failure only they see (a full disk, a permission
    error) must not leave the others waiting in the next collective until the process-group timeout. The
    failing rank re-raises its own error, the others a RuntimeError naming it. Also a barrier.
    """
    result, error = None, None
    if not rank0_only or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every error must reach the other ranks
            error = err
    errors: list[tuple[str, int | None] | None] = [None] * dist.get_world_size()
    mine = None if error is None else (f"{type(error).__name__}: {error}", getattr(error, "errno", None))
    dist.all_gather_object(errors, mine)
    if error is not None:
        raise error
    failed = [(rank, entry) for rank, entry in enumerate(errors) if entry is not None]
    if failed:
        rank, (msg, code) = failed[0]
        if code in STORAGE_ERRNOS:  # the same storage error on every rank (``_storage_errors`` reports it)
            raise OSError(code, f"on rank {rank}: {msg}")
        raise RuntimeError(f"checkpoint step failed on rank {rank}: {msg}")
    return result


def _broadcast_from_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and give every rank its result. An error there is raised on every rank: a
    ValueError (bad input) as a ValueError with the same message, anything else as itself on rank 0 and as a
    RuntimeError elsewhere (so no rank waits in a later collective)."""
    box: list[T | None] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - every error must reach the other ranks
            error = err
            box[0] = ("error", (isinstance(err, ValueError), f"{type(err).__name__}: {err}"))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "ok":
        return value
    if error is not None:
        raise error
    is_value_error, message = value
    if is_value_error:
        raise ValueError(message.removeprefix("ValueError: "))
    raise RuntimeError(f"checkpoint step failed on rank 0: {message}")


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
"""Filesystem errors that are the storage's, not a bug: reported in one line naming the directory."""


@contextlib.contextmanager
def _storage_errors(save_dir: Path, step: int) -> Iterator[None]:
    """A full disk / read-only or unwritable save_dir (on this rank, or on another: ``_together`` keeps its
    errno) becomes one RuntimeError naming the directory and the intact previous checkpoint."""
    try:
        yield
    except OSError as err:
        if err.errno not in STORAGE_ERRNOS:
            raise
        previous = layout.read_latest(save_dir)
        kept = (f"the previous checkpoint {previous} is intact" if previous is not None and previous.is_dir()
                else "no earlier checkpoint exists")
        raise RuntimeError(
            f"saving checkpoint step {step} to {save_dir} failed: {os.strerror(err.errno)} ({err}); {kept}. Free "
            "space on or fix permissions of that directory (checkpoint.save_dir), then run the same command again "
            "to resume"
        ) from err


@contextlib.contextmanager
def _deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds`` (no-op off the main thread or when None)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{what} took longer than {seconds} s (checkpoint.save_timeout_s); "
                           "the previous checkpoint is untouched")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
