"""On-disk layout of megatron_rl checkpoints: atomic publication, the ``latest`` pointer, manifests, pruning.

Place in the data flow: the last stage of a training step (docs/DESIGN.md section 1, "checkpoint"). This module is
pure filesystem code (no torch.distributed, no Megatron); ``checkpoint/dist.py`` drives it from every rank.

    save_dir/
      latest                    "step_00000012\\n"; replaced atomically, written after the directory is final
      step_00000010/            a complete checkpoint (only ever created by a rename)
        common.pt  __<rank>_<i>.distcp  .metadata  metadata.json      megatron-core dist_checkpointing
        rng/rank_00000.pt ...   per-rank RNG states
        trainer_state.json      step, consumed prompts, data position (whatever the trainer passes)
        config.yaml             the resolved MegatronRLConfig
        manifest.json           written last inside the temporary directory: size and CRC32 of every file
      .tmp.step_00000012/       a save in progress or a crashed one: never read, removed by the next save

Crash safety (docs/CHECKPOINTS.md section 3): a save writes into a fresh temporary directory, fsyncs every
file and the directory, renames it to ``step_<n>``, fsyncs the parent, and only then replaces ``latest``.
A crash at any point leaves either the previous ``latest`` or the new one pointing at a complete directory.
``resolve_checkpoint`` never returns a directory without a manifest (written last, after every file is
fsynced); loading then checks each file's size and CRC32 against it and raises ValueError on a mismatch
(bit rot, a file changed after the save) instead of loading it.

``fault_point(stage)`` is a test hook: ``MEGATRON_RL_CKPT_FAULT="<stage>:<action>"`` makes a save crash
(``kill``: SIGKILL itself; ``exit``: ``os._exit(17)``; ``raise``: RuntimeError), or ``sleep`` (first touching
the file named by ``MEGATRON_RL_CKPT_FAULT_MARK`` so a test can SIGKILL it from outside) at a named stage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import zlib
from pathlib import Path
from typing import Any

from megatron_rl.atomic import atomic_write_text, fsync_dir, fsync_file  # noqa: F401 - re-exported

CHECKPOINT_FORMAT_VERSION = 1
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"
_NAME_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp."
_TRASH_PREFIX = ".trash."
CORRUPT_PREFIX = ".corrupt."
"""A checkpoint that failed verification on resume is renamed ``.corrupt.step_N`` (kept for inspection)."""

FAULT_ENV = "MEGATRON_RL_CKPT_FAULT"
FAULT_MARK_ENV = "MEGATRON_RL_CKPT_FAULT_MARK"
FAULT_STAGES = ("tmp_created", "shards_written", "manifest_written", "renamed", "latest_written")
"""Named points of a save, in order (see ``checkpoint/dist.py::save_parts``)."""


# ---------------------------------------------------------------------------------------------- names


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` train steps."""
    if step < 0:
        raise ValueError(f"trainer_state['step']={step} must be >= 0 to name a checkpoint")
    return f"step_{step:08d}"


def tmp_dir_for(save_dir: Path, step: int) -> Path:
    return save_dir / f"{_TMP_PREFIX}{checkpoint_name(step)}"


def step_of(path: Path) -> int | None:
    """Step encoded in a checkpoint directory name, or None for anything else."""
    match = _NAME_RE.match(path.name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------------- durability


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- manifest


def file_record(path: Path, *, fsync: bool = True) -> dict[str, int]:
    """Size and CRC32 of one file (read in 8 MiB blocks); fsyncs it on the way when asked."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
        if fsync:
            os.fsync(f.fileno())
    return {"size": path.stat().st_size, "crc32": crc}


def list_files(ckpt_dir: Path) -> list[str]:
    """Relative paths of every regular file below ``ckpt_dir`` except the manifest, sorted."""
    files = [p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*") if p.is_file()]
    return sorted(f for f in files if f != MANIFEST_FILE)


def write_manifest(ckpt_dir: Path, files: dict[str, dict[str, int]], info: dict[str, Any]) -> None:
    manifest = {"format_version": CHECKPOINT_FORMAT_VERSION, **info, "files": files}
    atomic_write_text(ckpt_dir / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; ValueError if it is missing or unreadable."""
    path = ckpt_dir / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(
            f"{ckpt_dir} is not a complete megatron_rl checkpoint (no {MANIFEST_FILE}); pass a checkpoint "
            f"directory written by save_checkpoint, or its parent save_dir"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is corrupt ({err}); use another checkpoint") from err
    if manifest.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version={manifest.get('format_version')!r}, this code reads "
            f"{CHECKPOINT_FORMAT_VERSION}; use a checkpoint written by this version of megatron_rl"
        )
    return manifest


def verify_files(ckpt_dir: Path, manifest: dict[str, Any], names: list[str], checksums: bool) -> list[str]:
    """Problems found in ``names`` (subset of the manifest's files): missing, wrong size, wrong CRC32."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = ckpt_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{name}: size {path.stat().st_size} != {expected['size']}")
        elif checksums and file_record(path, fsync=False)["crc32"] != expected["crc32"]:
            problems.append(f"{name}: CRC32 mismatch")
    return problems


# ---------------------------------------------------------------------------------------------- discovery


def read_latest(save_dir: Path) -> Path | None:
    """The directory named by ``save_dir/latest`` if the pointer exists and names a checkpoint directory."""
    try:
        name = (save_dir / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):  # missing, or damaged (random bytes): callers scan instead
        return None
    if _NAME_RE.match(name) is None:
        return None
    return save_dir / name


def complete_checkpoints(save_dir: Path) -> list[Path]:
    """``step_*`` directories of ``save_dir`` holding a manifest, by increasing step."""
    if not save_dir.is_dir():
        return []
    found = [p for p in save_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted((p for p in found if (p / MANIFEST_FILE).is_file()), key=lambda p: step_of(p))


def checkpoint_dirs(save_dir: Path) -> list[Path]:
    """Every ``step_*`` directory of ``save_dir`` (complete or not), by increasing step."""
    if not save_dir.is_dir():
        return []
    return sorted((p for p in save_dir.iterdir() if p.is_dir() and step_of(p) is not None), key=lambda p: step_of(p))


def resume_candidates(path: str | os.PathLike, fallback: bool) -> list[Path]:
    """Checkpoint directories to try, in order, when resuming from ``path``.

    A checkpoint directory itself, or strict mode (``fallback=False``): ``[resolve_checkpoint(path)]``. A save_dir
    with fallback: the target of ``latest`` first (when it is a directory), then every other ``step_*``
    directory, newest first, complete or not (a damaged one fails verification and is reported).
    """
    path = Path(path)
    if not fallback or (path / MANIFEST_FILE).is_file() or not checkpoint_dirs(path):
        return [resolve_checkpoint(path)]
    latest = read_latest(path)
    ordered = [latest] if latest is not None and latest.is_dir() else []
    return ordered + [p for p in reversed(checkpoint_dirs(path)) if p not in ordered]


def manifest_or_problem(ckpt_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, or ``(None, why)`` when the manifest is missing or unreadable."""
    try:
        return read_manifest(ckpt_dir), None
    except ValueError as err:
        return None, str(err)


def move_aside(ckpt_dir: Path) -> str:
    """Rename a checkpoint that failed verification to ``.corrupt.<name>`` (a new suffix if taken); returns
    what happened, for the warning. Never deletes: the files stay for inspection."""
    target = ckpt_dir.with_name(f"{CORRUPT_PREFIX}{ckpt_dir.name}")
    n = 1
    while target.exists():
        target, n = ckpt_dir.with_name(f"{CORRUPT_PREFIX}{ckpt_dir.name}.{n}"), n + 1
    try:
        os.rename(ckpt_dir, target)
        fsync_dir(ckpt_dir.parent)
    except OSError as err:
        return f"left in place (could not rename it: {err})"
    return f"moved to {target}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint directory from ``path``: the directory itself if it has a manifest, else (a
    save_dir) the target of ``latest``, falling back to the newest complete ``step_*`` directory when the
    pointer is missing or dangling. ValueError naming ``path`` if there is none."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} does not exist or is not a directory")
    if (path / MANIFEST_FILE).is_file():
        return path
    latest = read_latest(path)
    if latest is not None and (latest / MANIFEST_FILE).is_file():
        return latest
    candidates = complete_checkpoints(path)
    if not candidates:
        raise ValueError(
            f"no complete checkpoint in {str(path)!r} (no {LATEST_FILE} pointer to a directory with "
            f"{MANIFEST_FILE}, no complete step_* directory); check checkpoint.save_dir or pass a checkpoint dir"
        )
    return candidates[-1]


# ---------------------------------------------------------------------------------------------- publication


def clear_stale_tmp(save_dir: Path) -> None:
    """Remove leftovers of crashed saves: temporary and trash directories, and the temporary file of a ``latest``
    pointer whose writer was killed before its rename (``atomic_write_text``: ``.tmp.latest.<pid>``)."""
    for p in save_dir.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            remove_tree(p)
        elif p.is_file() and p.name.startswith(f"{_TMP_PREFIX}{LATEST_FILE}."):
            p.unlink(missing_ok=True)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished temporary directory to its final name (replacing an older save of the same step).

    Replacing takes two renames (old -> trash, tmp -> final); a crash between them leaves no ``step_<n>``
    directory for a moment, and ``resolve_checkpoint`` then falls back to the newest complete one.
    """
    save_dir = final_dir.parent
    fsync_dir(tmp_dir)
    trash = None
    if final_dir.exists():
        trash = save_dir / f"{_TRASH_PREFIX}{final_dir.name}"
        remove_tree(trash)
        os.rename(final_dir, trash)
    os.rename(tmp_dir, final_dir)
    fsync_dir(save_dir)
    if trash is not None:
        remove_tree(trash)


def write_latest(save_dir: Path, final_dir: Path) -> None:
    atomic_write_text(save_dir / LATEST_FILE, final_dir.name + "\n")


def prune(save_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints (never the one ``latest`` names)."""
    assert keep_last >= 1, keep_last
    latest = read_latest(save_dir)
    complete = complete_checkpoints(save_dir)
    doomed = [p for p in complete[: max(0, len(complete) - keep_last)] if p != latest]
    for p in doomed:
        remove_tree(p)
    return doomed


# ---------------------------------------------------------------------------------------------- test hook


def fault_point(stage: str) -> None:
    """Crash or stall here if ``MEGATRON_RL_CKPT_FAULT`` names this stage (test hook; no-op otherwise)."""
    assert stage in FAULT_STAGES, stage
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or spec.split(":")[0] != stage:
        return
    action = spec.split(":")[1] if ":" in spec else "kill"
    if action == "raise":
        raise RuntimeError(f"injected checkpoint fault at stage {stage!r}")
    if action == "exit":
        os._exit(17)
    if action == "sleep":
        mark = os.environ.get(FAULT_MARK_ENV)
        if mark:
            Path(mark).write_text(stage)
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
