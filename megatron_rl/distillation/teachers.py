"""The teachers of on-policy distillation: checked at start-up, built as frozen Megatron models in the trainer's
ranks, or (``engine: vllm``) served by a vLLM server of their own (``served.py``; docs/DISTILLATION.md).

Place in the data flow: set-up, beside the reference model (job/main.py ``build_job``). A teacher is
``MegatronPolicy(role='reference')`` built by ``hf.weights.policy_from_hf`` from its own checkpoint: its own
shapes (layers, hidden size, heads, from its config.json), the policy's parallel layout (TP/PP/DP, the same
process groups), no DDP, no optimizer; it scores a batch through the reference model's forward (packed THD,
per-token log-probs from the vocab-parallel logits). Fields that are not part of a checkpoint (``params_dtype``,
``attention_backend``) are the student's.

Vocabulary (``check_teachers``, files only, before any collective): every token the student can sample must be
a token of the teacher with the same meaning. The teacher's ``vocab_size`` must be >= the student's, and when
both checkpoints have tokenizer files their vocabularies (token -> id) must be equal. A mismatch is one
``ConfigError`` line naming the teacher's key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError, LoraConfig, MegatronRLConfig
from megatron_rl.distillation.offload import OffloadedTeacher
from megatron_rl.distillation.signal import Distillation
from megatron_rl.hf.config import model_config_from_hf
from megatron_rl.hf.tokenizer import TOKENIZER_FILES, load_tokenizer


def _has_tokenizer(hf_dir: str | None) -> bool:
    return hf_dir is not None and any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES)


def _vocabulary_mismatch(student_dir: str, teacher_dir: str, key: str) -> str | None:
    """Why the two tokenizers differ (token -> id), or None when they agree."""
    student = load_tokenizer(student_dir, key="model.hf_path").get_vocab()
    teacher = load_tokenizer(teacher_dir, key=key).get_vocab()
    differing = sorted(t for t in student.keys() | teacher.keys() if student.get(t) != teacher.get(t))
    if not differing:
        return None
    example = differing[0]
    return (f"{len(differing)} token(s) differ, e.g. {example!r}: id {student.get(example)} in the student, "
            f"{teacher.get(example)} in the teacher")


def check_teachers(config: MegatronRLConfig) -> None:
    """ConfigError (one line) for a teacher that cannot score the student's tokens: no readable checkpoint, a
    smaller vocabulary, or another tokenizer; and for ``kind: full_kl`` under context parallelism. Reads files
    only (no collective): call it on every rank."""
    student = config.model
    if config.distillation.kind == "full_kl" and config.parallel.context_parallel_size > 1:
        raise ConfigError(f"distillation.kind=full_kl with parallel.context_parallel_size="
                          f"{config.parallel.context_parallel_size} is not supported yet (not tested under context "
                          "parallelism); set parallel.context_parallel_size=1 or distillation.kind=reverse_kl")
    for i, teacher in enumerate(config.distillation.teachers):
        key = f"distillation.teachers[{i}].hf_path"
        try:
            teacher_model = model_config_from_hf(teacher.hf_path, key=key)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if teacher_model.vocab_size < student.vocab_size:
            raise ConfigError(
                f"{key}={teacher.hf_path!r}: the teacher's vocab_size {teacher_model.vocab_size} is smaller than the "
                f"student's {student.vocab_size}; the student can sample every id below its vocab_size, so the "
                "teacher must share its tokenizer with at least as many ids (cross-tokenizer distillation is not "
                "supported)")
        if _has_tokenizer(student.hf_path) and _has_tokenizer(teacher.hf_path):
            why = _vocabulary_mismatch(student.hf_path, teacher.hf_path, key)
            if why is not None:
                raise ConfigError(f"{key}={teacher.hf_path!r}: the teacher's tokenizer is not the student's ({why}); "
                                  "a teacher must share the student's tokenizer (cross-tokenizer distillation is "
                                  "not supported)")


def teacher_config(config: MegatronRLConfig) -> MegatronRLConfig:
    """The config a teacher is built from: the student's, whose model section keeps only what a checkpoint does
    not hold (dtype, attention backend); ``policy_from_hf`` fills the shapes from the teacher's config.json."""
    base = dataclasses.replace(config.model, hf_path=None, family=None, lora=LoraConfig(), num_moe_experts=None,
                               moe_router_replay="none")
    return dataclasses.replace(config, model=base)


def build_teachers(config: MegatronRLConfig, groups: Any, pad_token_id: int, rollout: Any = None) -> list[Any]:
    """One frozen teacher per ``distillation.teachers`` entry (collective: call on every rank): a
    ``MegatronPolicy`` loaded from its checkpoint (``engine: megatron``), or a ``ServedTeacher`` whose server
    rank 0 starts (``engine: vllm``; ``rollout``: the job's ``RolloutConfig``, for the engine's settings).
    ``pad_token_id``: the student's (the batch is padded with it; ``attention_mask`` hides padding, so the teacher
    never reads it)."""
    from megatron_rl.hf.weights import policy_from_hf

    check_teachers(config)
    served = [t.name for t in config.distillation.teachers if t.engine == "vllm"]
    if served and rollout is None:
        raise ValueError(f"distillation teachers {served} have engine: vllm, which needs the job's rollout settings "
                         "(build_distillation(..., rollout=job_config.rollout)); or set their engine: megatron")
    base, teachers = teacher_config(config), []
    for teacher in config.distillation.teachers:
        if groups.rank == 0:
            rows = "every row" if teacher.when is None else f"the rows where {teacher.when}"
            offload = ""
            if teacher.offload:
                offload = ("; offload: on the host between scoring passes" if groups.device.type != "cpu" else
                           "; offload: nothing to move on a CPU device")
            print(f"distillation: teacher {teacher.name!r} from {teacher.hf_path} ({teacher.engine}"
                  f"{' at ' + teacher.url if teacher.url else ''}) scores {rows} "
                  f"(coef {config.distillation.coef} x weight {teacher.weight}, {config.distillation.kind}{offload})",
                  flush=True)
        if teacher.engine == "vllm":
            teachers.append(_served_teacher(config, teacher, groups, rollout))
        else:
            model = policy_from_hf(base, groups, role="reference", hf_dir=teacher.hf_path, pad_token_id=pad_token_id)
            teachers.append(OffloadedTeacher(model) if teacher.offload else model)
    return teachers


def _served_teacher(config: MegatronRLConfig, teacher: Any, groups: Any, rollout: Any) -> Any:
    """A ``ServedTeacher`` of ``teacher`` (rank 0 starts its server, or attaches ``teacher.url``; see
    ``distillation/served.py``)."""
    import torch

    from megatron_rl.distillation.served import SCORE_MAX_TOKENS, ServedTeacher, served_options

    if teacher.url is not None:
        return ServedTeacher.attach(teacher.name, teacher.url, rank=groups.rank,
                                    start_timeout_s=rollout.start_timeout_s, timeout_s=rollout.request_timeout_s)

    shapes = model_config_from_hf(teacher.hf_path, key=f"distillation.teachers[{teacher.name}].hf_path")
    # the student's longest row (its engine's context) and the token vLLM generates after it (never read)
    max_len = (rollout.max_model_len or config.model.max_position_embeddings) + SCORE_MAX_TOKENS
    try:  # (the engine's interpreter: the same answer on every rank)
        options = served_options(rollout, dataclasses.replace(shapes, params_dtype=config.model.params_dtype),
                                 groups.device.type, max_len, config.seed)
    except ValueError as err:
        raise ConfigError(f"distillation teacher {teacher.name!r} has engine: vllm: {err}") from None
    device = None
    if groups.device.type == "cuda" and torch.cuda.device_count():  # after the policy's engines (wrapping)
        policy_devices = rollout.num_engines * rollout.engine_tensor_parallel_size if rollout.engine == "vllm" else 0
        device = str(policy_devices % torch.cuda.device_count())
    log_path = Path(config.logging.output_dir) / "engine" / f"teacher_{teacher.name}.log"
    return ServedTeacher.start(teacher.name, teacher.hf_path, options, rank=groups.rank, log_path=log_path,
                               start_timeout_s=rollout.start_timeout_s, timeout_s=rollout.request_timeout_s,
                               device=device)


def build_distillation(config: MegatronRLConfig, groups: Any, pad_token_id: int, rollout: Any = None
                       ) -> Distillation | None:
    """The ``Distillation`` the Trainer takes (``Trainer(distillation=...)``), or None when no teacher is set."""
    if not config.distillation.enabled:
        return None
    return Distillation(config.distillation, build_teachers(config, groups, pad_token_id, rollout))
