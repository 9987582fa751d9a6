"""Atomic file replacement: the one helper every file a run rewrites goes through.

A reader (or a resumed run) sees the old content or the new one, never a torn or empty file, whatever instant
the writer is killed at: the new content goes to a temporary file beside the target (same filesystem), is
flushed and fsynced, then renamed over the target (``os.replace`` is atomic on POSIX), and the directory is
fsynced so the rename itself survives a power loss. Used by checkpoints (``checkpoint/layout.py``), the
config dump (``config.write_yaml``) and the main job's outputs (``job/reporting.py``). No torch, no Megatron.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

TMP_PREFIX = ".tmp."


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_replace(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it is fsynced and renamed over ``path``.

    On an exception the temporary file is removed and ``path`` is untouched. For writers that want a path
    (``savefig``); text goes through ``atomic_write_text``.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new content, never a torn file."""
    with atomic_replace(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
