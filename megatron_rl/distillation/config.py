"""The ``distillation`` config section: on-policy distillation from frozen teachers (docs/DISTILLATION.md).

A teacher is a Hugging Face checkpoint of its own size (layers, hidden) that shares the student's tokenizer. The
student samples as in RL; each teacher scores the sampled tokens of its rows; the per-token reverse KL
``log pi_student(y_t) - log pi_teacher(y_t)`` times ``-coef * weight`` joins the token's advantage
(``distillation/signal.py``).

    distillation:
      teachers: [{name: big, hf_path: /ckpt/teacher}]    # one teacher: every row
      coef: 1.0
      kind: reverse_kl

This module imports nothing of ``megatron_rl.config`` (which imports it): it checks its own fields and the rules
between them; the rules that need files (vocabularies) are in ``distillation/teachers.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from megatron_rl.config_files import ConfigError
from megatron_rl.config_rules import NON_NEGATIVE, ConfigSection, FINITE, check_fields

@dataclass(kw_only=True)
class TeacherConfig:
    """One frozen teacher (an entry of ``distillation.teachers``)."""

    name: str
    """Short name of the teacher: its metrics are ``distill/<name>/reverse_kl``, ``distill/<name>/tokens``,
    ``distill/<name>/time_s``. Letters, digits, '_', '-' and '.'; unique among the teachers."""
    hf_path: str
    """Local Hugging Face checkpoint directory of the teacher (config.json + *.safetensors; no downloads). Its
    shapes (layers, hidden size, heads) are its own; its vocabulary must hold every token the student can sample
    and its tokenizer (when both have one) must be the student's."""
    weight: float = field(default=1.0, metadata=FINITE)
    """Multiplies this teacher's term: a row scored by it gets ``-distillation.coef * weight * (logp_student -
    logp_teacher)`` per sampled token."""
    engine: Literal["megatron", "vllm"] = "megatron"
    """Where the teacher runs. 'megatron': a frozen Megatron model in the trainer's ranks (the policy's parallel
    layout; its weights in every rank's memory). 'vllm': its own ``vllm serve`` of ``hf_path`` started by rank 0
    (``distillation/served.py``: the engine interpreter, dtype rule, KV cache and memory share of ``rollout.*``;
    its log ``<logging.output_dir>/engine/teacher_<name>.log``), which scores its rows by prompt log-probs and
    broadcasts them: no teacher weights in the trainer (docs/DISTILLATION.md says when to use which)."""
    url: str | None = None
    """``engine: vllm`` only: attach the teacher's server already running at this URL (``http://host:port``,
    started by hand with ``python -m megatron_rl.inference.engine_process.vllm_serve <hf_path> ...`` and
    ``$MEGATRON_RL_ENGINE_TOKEN``, which the job reads too; docs/DISTILLATION.md) instead of starting one; the job
    never kills or restarts it. ``hf_path`` is still read (vocabulary check, shapes)."""
    offload: bool = False
    """``engine: megatron`` only: keep the teacher's weights in (pinned) host memory between scoring passes and
    copy them to the device for each step's scoring (``distillation/offload.py``): no teacher weights on the GPU
    while the policy trains, for one host-to-device copy of the teacher per step. On a CPU device it moves
    nothing (said at start-up)."""
    when: dict[str, Any] | None = None
    """Rows this teacher scores, ``{column: value}`` over the prompt row's data columns (every pair must equal
    the row's value); None = every row. Needs rows with data columns (``job.environment: single_turn``: the
    prompt files' columns; a step-API class or an agent: its data rows' columns, every turn of an episode its
    row's teacher; ``next_digit`` and registered environments have none: a ``when`` there is a ConfigError).
    With several teachers each needs a ``when``, and no training row may match two (checked at start-up); rows
    matched by none get no distillation term (``distill/unscored_rows``)."""


ENGINES = ("megatron", "vllm")
"""Values of ``distillation.teachers[i].engine``."""
_TEACHER_FIELDS = tuple(f.name for f in dataclasses.fields(TeacherConfig))


def _teacher(entry: Any, index: int) -> TeacherConfig:
    """``distillation.teachers[index]`` as a ``TeacherConfig`` (a mapping from YAML, or one already built)."""
    key = f"distillation.teachers[{index}]"
    if isinstance(entry, TeacherConfig):
        entry = dataclasses.asdict(entry)
    if not isinstance(entry, dict):
        raise ConfigError(f"{key}={entry!r} must be a mapping like {{name: big, hf_path: /ckpt/teacher}}")
    for name in entry:
        if name not in _TEACHER_FIELDS:
            match = difflib.get_close_matches(str(name), _TEACHER_FIELDS, n=1, cutoff=0.6)
            hint = f"did you mean {match[0]!r}?" if match else f"valid keys: {list(_TEACHER_FIELDS)}"
            raise ConfigError(f"unknown key {key}.{name}; {hint}")
    for name in ("name", "hf_path"):
        if not isinstance(entry.get(name), str) or not entry[name]:
            raise ConfigError(f"{key}.{name} is missing or not a string ({entry.get(name)!r}); every teacher needs "
                              "name (for its metrics) and hf_path (a local HF checkpoint directory)")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"{key}.weight={weight!r} must be a number")
    when = entry.get("when")
    if when is not None and not (isinstance(when, dict) and when):
        raise ConfigError(f"{key}.when={when!r} must be a non-empty mapping {{column: value}} or unset (every row)")
    for column, value in (when or {}).items():
        if not isinstance(column, str) or not (value is None or isinstance(value, (str, int, float, bool))):
            raise ConfigError(f"{key}.when={when!r}: each entry must be column: value with a string column and a "
                              f"scalar value (string, number, bool or null), got {column!r}: {value!r}")
    engine = entry.get("engine", "megatron")
    if engine not in ENGINES:
        raise ConfigError(f"{key}.engine={engine!r} must be one of {list(ENGINES)} ('megatron': in the trainer's "
                          "ranks; 'vllm': a vLLM server of its own)")
    offload = entry.get("offload", False)
    if not isinstance(offload, bool):
        raise ConfigError(f"{key}.offload={offload!r} must be true or false")
    if offload and engine == "vllm":
        raise ConfigError(f"{key}.offload=true with engine: vllm: a served teacher's weights live in its own server, "
                          "not in the trainer; unset offload (or use engine: megatron)")
    url = entry.get("url")
    if url is not None:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ConfigError(f"{key}.url={url!r} is not a server URL (http://host:port)")
        if engine != "vllm":
            raise ConfigError(f"{key}.url={url!r} attaches a served teacher: set {key}.engine=vllm (or unset url: "
                              "engine: megatron runs the teacher in the trainer's ranks)")
    teacher = TeacherConfig(name=entry["name"], hf_path=entry["hf_path"], weight=float(weight), when=when,
                            engine=engine, offload=offload, url=url)
    check_fields(teacher, f"{key}.")
    return teacher


@dataclass(kw_only=True)
class DistillationConfig(ConfigSection):
    """On-policy distillation (docs/DISTILLATION.md): frozen teachers score the student's sampled tokens and the
    per-token reverse KL joins the advantage. Off when ``teachers`` is empty (the default)."""

    SECTION: ClassVar[str] = "distillation"

    teachers: list[TeacherConfig] = field(default_factory=list)
    """The teachers, each ``{name, hf_path, weight, when}`` (``TeacherConfig``); [] = no distillation. A
    one-liner: ``distillation.teachers=[{name: big, hf_path: /ckpt/teacher}]``; several, one per domain:
    ``[{name: m, hf_path: /ckpt/math, when: {domain: math}}, {name: c, hf_path: /ckpt/code, when: {domain: code}}]``."""
    coef: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Weight of the distillation term beside the task advantage: each sampled token's advantage gets
    ``-coef * weight * (logp_student - logp_teacher)`` (``kind: full_kl``: the loss gets ``coef * weight`` times
    the token mean of the full KL). Pure distillation: rewards that are all 0 (GRPO/RLOO
    then give a zero task advantage), so the term is the whole advantage; in the ``single_turn`` environment
    ``reward.function`` may then be left unset (every reward 0) when ``coef > 0``."""
    kind: Literal["reverse_kl", "full_kl"] = "reverse_kl"
    """'reverse_kl': the per-token reverse KL on the sampled tokens (their log-probs only) joins the advantage,
    ``-coef * weight * (logp_student - logp_teacher)``. 'full_kl': the full-vocabulary reverse KL
    ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` of the next-token distributions on every loss token, a
    differentiable loss term ``coef * weight * KL`` normalized like the reference KL (``algorithm.use_kl_loss``: a
    token mean over the mini-batch's loss tokens), the advantages untouched; in-trainer teachers only (``engine:
    megatron``), computed over the student's vocabulary (``model.vocab_size`` ids); each update runs the teachers'
    forward on the update's micro-batches (distillation/full_kl.py, docs/DISTILLATION.md: cost, layouts)."""

    def __post_init__(self) -> None:
        self.teachers = [_teacher(entry, i) for i, entry in enumerate(self.teachers or [])]
        super().__post_init__()

    @property
    def enabled(self) -> bool:
        """Whether any teacher is configured."""
        return bool(self.teachers)

    def _check_rules(self) -> None:
        for i, teacher in enumerate(self.teachers):
            if self.kind == "full_kl" and teacher.engine != "megatron":
                raise ConfigError(f"distillation.teachers[{i}].engine={teacher.engine!r} with distillation.kind="
                                  "full_kl: a server returns log-probs of given tokens, not full distributions; use "
                                  "engine: megatron (in the trainer) or kind: reverse_kl")
        names = [t.name for t in self.teachers]
        for i, name in enumerate(names):
            if not all(c.isalnum() or c in "_-." for c in name):
                raise ConfigError(f"distillation.teachers[{i}].name={name!r}: use letters, digits, '_', '-' or '.' "
                                  "(it names the teacher's metrics distill/<name>/...)")
            if name in names[:i]:
                raise ConfigError(f"distillation.teachers[{i}].name={name!r} is used twice; give each teacher its "
                                  "own name")
        if len(self.teachers) > 1:
            for i, teacher in enumerate(self.teachers):
                if teacher.when is None:
                    raise ConfigError(
                        f"distillation.teachers[{i}].when is unset but there are {len(self.teachers)} teachers: a "
                        "teacher without 'when' scores every row, so every row would have two teachers; give each "
                        "teacher its rows, e.g. when: {domain: math}")

    @property
    def routed(self) -> bool:
        """Whether rows are routed to teachers by a data column (some teacher has ``when``)."""
        return any(t.when is not None for t in self.teachers)
