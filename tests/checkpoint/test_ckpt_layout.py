"""Checkpoint directory layout: discovery, manifest verification, publication, pruning (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.checkpoint import layout


def _fake_checkpoint(save_dir: Path, step: int, payload: bytes = b"abc") -> Path:
    """A complete checkpoint as a save publishes it: files, manifest, rename."""
    tmp = layout.tmp_dir_for(save_dir, step)
    tmp.mkdir(parents=True)
    (tmp / "common.pt").write_bytes(payload)
    (tmp / layout.RNG_DIR).mkdir()
    (tmp / layout.RNG_DIR / "rank_00000.pt").write_bytes(payload * 2)
    records = {name: layout.file_record(tmp / name) for name in layout.list_files(tmp)}
    layout.write_manifest(tmp, records, {"step": step})
    final = save_dir / layout.checkpoint_name(step)
    layout.publish(tmp, final)
    layout.write_latest(save_dir, final)
    return final


def test_resolve_prefers_latest_then_newest_complete(tmp_path):
    first = _fake_checkpoint(tmp_path, 1)
    second = _fake_checkpoint(tmp_path, 2)
    assert layout.resolve_checkpoint(tmp_path) == second
    assert layout.resolve_checkpoint(first) == first
    # a crashed save (temporary directory) and a dangling pointer are never selected
    layout.tmp_dir_for(tmp_path, 3).mkdir()
    (tmp_path / layout.LATEST_FILE).write_text("step_00000003\n")
    assert layout.resolve_checkpoint(tmp_path) == second
    # a garbage pointer falls back too
    (tmp_path / layout.LATEST_FILE).write_text("../../etc\n")
    assert layout.resolve_checkpoint(tmp_path) == second
    # a renamed directory without manifest (impossible through publish, but e.g. copied by hand) is skipped
    (tmp_path / "step_00000009").mkdir()
    assert layout.resolve_checkpoint(tmp_path) == second


def test_resolve_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        layout.resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        layout.resolve_checkpoint(tmp_path)


def test_manifest_detects_missing_truncated_and_flipped_files(tmp_path):
    ckpt = _fake_checkpoint(tmp_path, 5, payload=b"0123456789")
    manifest = layout.read_manifest(ckpt)
    names = sorted(manifest["files"])
    assert names == ["common.pt", "rng/rank_00000.pt"]
    assert layout.verify_files(ckpt, manifest, names, checksums=True) == []
    data = bytearray((ckpt / "common.pt").read_bytes())
    data[3] ^= 1
    (ckpt / "common.pt").write_bytes(bytes(data))
    assert layout.verify_files(ckpt, manifest, names, checksums=False) == []  # same size
    assert layout.verify_files(ckpt, manifest, names, checksums=True) == ["common.pt: CRC32 mismatch"]
    (ckpt / "common.pt").write_bytes(b"01")
    assert "size" in layout.verify_files(ckpt, manifest, names, checksums=False)[0]
    (ckpt / "rng" / "rank_00000.pt").unlink()
    assert layout.verify_files(ckpt, manifest, names, False)[1] == "rng/rank_00000.pt: missing"
    (ckpt / layout.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        layout.read_manifest(ckpt)


def test_publish_replaces_same_step_and_prune_keeps_last_n(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    again = _fake_checkpoint(tmp_path, 3, payload=b"new")
    assert (again / "common.pt").read_bytes() == b"new"
    removed = layout.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_00000001"]
    assert [p.name for p in layout.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    # the checkpoint named by latest survives pruning even when it is not among the newest
    (tmp_path / layout.LATEST_FILE).write_text("step_00000002\n")
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / layout.LATEST_FILE).write_text("step_00000002\n")
    layout.prune(tmp_path, keep_last=1)
    assert [p.name for p in layout.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    layout.tmp_dir_for(tmp_path, 7).mkdir()
    layout.clear_stale_tmp(tmp_path)
    assert not layout.tmp_dir_for(tmp_path, 7).exists()


def test_fault_point_raise_and_unknown_stage(monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, "renamed:raise")
    layout.fault_point("tmp_created")  # another stage: no effect
    with pytest.raises(RuntimeError, match="renamed"):
        layout.fault_point("renamed")
    with pytest.raises(AssertionError):
        layout.fault_point("no_such_stage")


def test_checkpoint_of_a_newer_megatron_core_is_refused_by_name(tmp_path):
    """0.17+ writes no common.pt; 0.16.x would fail inside dist_checkpointing with an AttributeError."""
    from importlib.metadata import version

    from megatron_rl.checkpoint import dist

    installed = version("megatron-core")
    newer = f"{int(installed.split('.')[0])}.{int(installed.split('.')[1]) + 1}.0"
    with pytest.raises(ValueError, match=f"written with megatron-core {newer}, newer than the installed {installed}"):
        dist._check_compatible({"megatron_core": newer}, None, True, tmp_path)
    assert dist._version_key("0.19.2") > dist._version_key("0.16.1")
    assert dist._version_key("0.16.1") == dist._version_key("0.16.0rc1")


def test_clear_stale_tmp_removes_a_killed_latest_write(tmp_path):
    """A SIGKILL between writing ``.tmp.latest.<pid>`` and its rename leaves that file; the next save removes it
    with the other leftovers (seen once in the random-kill test of test_ckpt_crash.py) and keeps everything else."""
    (tmp_path / ".tmp.latest.14262").write_text("step_00000003\n")
    (tmp_path / ".tmp.step_00000003").mkdir()
    (tmp_path / "latest").write_text("step_00000002\n")
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "notes.tmp.latest.txt").write_text("a user's file\n")
    layout.clear_stale_tmp(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.tmp.latest.txt", "step_00000002"]
