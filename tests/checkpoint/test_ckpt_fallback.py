"""Resume from the newest checkpoint that verifies (checkpoint/dist.py, checkpoint.resume_fallback).

One spawned rank: a reference run trains 4 steps, saving after steps 2 and 3 (keep_last=2). For each kind of
damage to the newest checkpoint (flipped or truncated shard, common.pt, .metadata, RNG file, trainer state,
manifest) a copy of the save_dir is damaged, a fresh policy resumes from it (step 2, with one warning naming
the damaged step_3, which is moved to .corrupt.step_00000003), trains steps 3 and 4, and must end bitwise equal
to the reference. Also: random bytes in ``latest``, strict mode, none verifying, and a full disk on save.
"""

from __future__ import annotations

import errno
import shutil
import warnings
from pathlib import Path

import pytest
from tests.support.ckpt_helpers import full_weights, make_batch, make_config, train_step

from tests.support.multirank import run_ranks

DAMAGE = {
    "flipped_shard": lambda d: _flip(sorted(d.glob("*.distcp"))[0]),
    "truncated_shard": lambda d: _cut(sorted(d.glob("*.distcp"))[0]),
    "common_pt": lambda d: _flip(_common_state_file(d)),
    "metadata": lambda d: _cut(d / ".metadata"),
    "rng": lambda d: _flip(d / "rng" / "rank_00000.pt"),
    "trainer_state": lambda d: (d / "trainer_state.json").write_text('{"step": 99}'),
    "manifest": lambda d: _cut(d / "manifest.json"),
}


def _common_state_file(ckpt: Path) -> Path:
    """``common.pt`` (megatron-core 0.16.1); 0.19.x keeps common state in the shards and writes none, so its
    ``metadata.json`` (dist_checkpointing's own small file) stands in: any damaged file must be caught."""
    common = ckpt / "common.pt"
    return common if common.exists() else ckpt / "metadata.json"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _policy():
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    config = make_config()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return MegatronPolicy(config, initialize_distributed(config.parallel, seed=config.seed))


def _run_to(policy, save_dir: Path, first: int, last: int, saves: tuple[int, ...] = ()) -> None:
    from megatron_rl.checkpoint import save_checkpoint

    for step in range(first, last + 1):
        train_step(policy, make_batch(seed=step))
        if step in saves:
            save_checkpoint(policy, save_dir, {"step": step})


def _resume(save_dir: Path, **kwargs) -> tuple[int | None, list[str], str | None]:
    from megatron_rl.checkpoint import load_checkpoint

    policy = _policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = load_checkpoint(policy, save_dir, **kwargs)["step"]
        except ValueError as err:
            return None, [], str(err)
    mine = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    _run_to(policy, save_dir, step + 1, 4)
    return step, mine, full_weights(policy)


def _child(rank: int, world_size: int, root: str) -> dict:
    import torch

    root = Path(root)
    policy = _policy()
    _run_to(policy, root / "ref", 1, 4, saves=(2, 3))
    reference = full_weights(policy)
    out = {}
    for name, damage in {**DAMAGE, "latest_random_bytes": None}.items():
        save_dir = root / name
        shutil.copytree(root / "ref", save_dir)
        if damage is None:
            (save_dir / "latest").write_bytes(bytes(range(256)))  # undecodable pointer: scan instead
        else:
            damage(save_dir / "step_00000003")
        step, warned, weights = _resume(save_dir)
        out[name] = {
            "step": step, "warned": warned, "error": None if step is not None else warned,
            "bitwise": step is not None and all(torch.equal(weights[k], reference[k]) for k in reference),
            "aside": sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".corrupt.")),
        }
    strict = root / "strict"
    shutil.copytree(root / "ref", strict)
    _flip(sorted((strict / "step_00000003").glob("*.distcp"))[0])
    out["strict"] = _resume(strict, fallback=False)[2]
    _flip(sorted((strict / "step_00000002").glob("*.distcp"))[0])
    out["none_verifies"] = _resume(strict)[2]
    out["none_verifies_kept"] = sorted(p.name for p in strict.iterdir())
    out["full_disk"] = _full_disk(root / "ref")
    return out


def _full_disk(save_dir: Path) -> str:
    """ENOSPC while writing the shards: one RuntimeError naming the directory and the intact previous step."""
    from unittest import mock

    from megatron_rl.checkpoint import save_checkpoint

    policy = _policy()
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch("megatron_rl.checkpoint.dist.dist_checkpointing.save", side_effect=full):
        try:
            save_checkpoint(policy, save_dir, {"step": 9})
        except RuntimeError as err:
            return str(err)
    return "no error"


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    return run_ranks(1, _child, str(tmp_path_factory.mktemp("ckpt_fallback")), timeout=900)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", [*DAMAGE])
def test_damaged_newest_checkpoint_is_skipped_and_resume_is_bitwise(fallback, name):
    entry = fallback[name]
    assert entry["step"] == 2 and entry["bitwise"], entry
    assert len(entry["warned"]) == 1 and "step_00000003" in entry["warned"][0], entry
    assert entry["aside"] == [".corrupt.step_00000003"], entry


@pytest.mark.multirank
def test_unreadable_latest_falls_back_to_scanning(fallback):
    entry = fallback["latest_random_bytes"]
    assert entry["step"] == 3 and entry["bitwise"] and entry["warned"] == [] and entry["aside"] == [], entry


@pytest.mark.multirank
def test_strict_mode_and_none_verifying(fallback):
    assert "step_00000003" in fallback["strict"] and "corrupt" in fallback["strict"]
    message = fallback["none_verifies"]
    assert "no complete checkpoint" in message and "step_00000003" in message and "step_00000002" in message
    assert "step_00000002" in fallback["none_verifies_kept"] and "step_00000003" in fallback["none_verifies_kept"]


@pytest.mark.multirank
def test_full_disk_on_save_names_the_directory_and_previous_step(fallback):
    message = fallback["full_disk"]
    assert "No space left on device" in message and "step_00000003 is intact" in message, message
