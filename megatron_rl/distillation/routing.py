"""Which teacher scores a row: the teachers' ``when`` over the prompt row's data columns (docs/DISTILLATION.md).

Place in the data flow: the environment's rollout (``single_turn``: each prompt row's columns; a step-API class or
an agent: each episode's data row, on every turn: ``failures.py: assemble_episodes``) writes
``GeneratorOutput['teacher_ids']`` (one int per sequence, -1 = none), which travels through merging and the
``TrainingBatch`` (``teacher_ids [B]``) to ``Distillation.score`` (each teacher's forward on its rows only).
At start-up, ``check_routing`` reads every training row once: a ``when`` column no row has, or a row two
teachers match, is a ConfigError naming the teacher's key. Rows not seen at start-up (none in the job's
environments; an agent's pre-flight reads its first 64 rows, its ranks all) go to the first teacher that matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_rl.config_files import ConfigError
from megatron_rl.distillation.config import DistillationConfig, TeacherConfig

NO_TEACHER = -1
"""``teacher_ids`` of a row no teacher scores."""


def matches(teacher: TeacherConfig, columns: Mapping[str, Any]) -> bool:
    """Whether ``teacher`` scores a row with these data columns (no ``when``: every row)."""
    if teacher.when is None:
        return True
    missing = object()
    return all(columns.get(column, missing) == value for column, value in teacher.when.items())


def teacher_of(teachers: Sequence[TeacherConfig], columns: Mapping[str, Any]) -> int:
    """Index of the first teacher matching the row, or ``NO_TEACHER``."""
    return next((i for i, teacher in enumerate(teachers) if matches(teacher, columns)), NO_TEACHER)


def check_routing(config: DistillationConfig, rows: Sequence[Mapping[str, Any]], files_key: str) -> None:
    """ConfigError for a ``when`` column that no row of ``files_key`` has, or a row that two teachers match."""
    present = set().union(*(row.keys() for row in rows)) if rows else set()
    for i, teacher in enumerate(config.teachers):
        for column in teacher.when or {}:
            if column not in present:
                raise ConfigError(f"distillation.teachers[{i}].when: no row of {files_key} has a column {column!r} "
                                  f"(columns: {sorted(present)}); route rows by one of those columns")
    for r, row in enumerate(rows):
        matched = [i for i, teacher in enumerate(config.teachers) if matches(teacher, row)]
        if len(matched) > 1:
            a, b = matched[:2]
            whens = {**(config.teachers[a].when or {}), **(config.teachers[b].when or {})}
            shown = {column: row.get(column) for column in whens}
            raise ConfigError(f"distillation.teachers[{a}] and [{b}] both match row {r} of {files_key} ({shown}): a "
                              "row has one teacher; make their 'when' exclusive")


def router(config: DistillationConfig) -> Callable[[Mapping[str, Any]], int] | None:
    """The environment's row -> teacher index function, or None when rows need no routing (no teacher with
    ``when``: every row is teacher 0's)."""
    if not config.routed:
        return None
    teachers = list(config.teachers)
    return lambda columns: teacher_of(teachers, columns)
