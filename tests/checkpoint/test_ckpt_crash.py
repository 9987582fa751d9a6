"""Crash safety, save timeout and bad input of checkpoints (one-rank processes).

Real kills: three ``ckpt_worker.py`` processes save in a loop (weights = init + step) and are SIGKILLed
(whole process group, helper processes included): two while stalled at a named stage of a save
(``shards_written``: files written, no manifest; ``renamed``: directory final, ``latest`` not yet replaced),
one at a random moment after its second complete save. Then one spawned rank checks that each directory
resolves to a complete checkpoint whose weights match its trainer state, that a new save into it works, and
runs the in-process checks: an injected failure at every stage of a save, the save deadline, and bad input
(missing / empty / corrupt / truncated checkpoint, another model shape, a bad trainer state), each a
ValueError that leaves the model untouched.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.ckpt_helpers import local_weights, make_config, set_weights_to_step
from tests.support.multirank import run_ranks
from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STALLED = ("shards_written", "renamed")


# ---------------------------------------------------------------------- worker processes (parent side)


def _start_worker(save_dir: Path, log: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.ckpt_worker", str(save_dir), *args], cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            _kill_group(proc)
            raise TimeoutError(f"worker did not reach the kill point:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the worker and its helper processes (dist_checkpointing's Manager and writers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _latest_step(save_dir: Path) -> int:
    try:
        return int((save_dir / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _run_killed_workers(root: Path) -> dict[str, str]:
    """Start all workers at once (they mostly import), kill each at its point; returns their save dirs."""
    root.mkdir(parents=True)
    workers = {}
    for stage in STALLED:
        mark = root / f"{stage}.mark"
        env = {"MEGATRON_RL_CKPT_FAULT_MARK": str(mark)}
        args = ("--fault", f"{stage}:sleep", "--fault-step", "3")
        workers[stage] = (_start_worker(root / stage, root / f"{stage}.log", *args, env=env), mark.exists)
    random_dir = root / "random"
    workers["random"] = (_start_worker(random_dir, root / "random.log"), lambda: _latest_step(random_dir) >= 2)
    for name, (proc, condition) in workers.items():
        _wait_for(condition, proc, root / f"{name}.log")
        if name == "random":
            time.sleep(random.Random(0).uniform(0.0, 0.5))  # somewhere inside a later save
        _kill_group(proc)
    return {name: str(root / name) for name in workers}


# ---------------------------------------------------------------------- checks (one spawned rank)


def _weights_match_step(policy, base: dict, step: int) -> bool:
    return all(torch.equal(p, base[name] + step) for name, p in policy.module.named_parameters())


def _killed_checks(policy, base: dict, killed: dict[str, str]) -> dict:
    from megatron_rl.checkpoint import layout

    out = {}
    for name, save_dir in killed.items():
        save_dir = Path(save_dir)
        leftovers = sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".tmp."))
        resolved = layout.resolve_checkpoint(save_dir)
        state = load_checkpoint(policy, str(save_dir))
        entry = {"resolved": resolved.name, "step": state["step"], "leftovers": leftovers,
                 "weights_ok": _weights_match_step(policy, base, state["step"])}
        set_weights_to_step(policy, base, 100)
        save_checkpoint(policy, str(save_dir), {"step": 100})
        entry["after_new_save"] = layout.resolve_checkpoint(save_dir).name
        entry["tmp_after_new_save"] = [p.name for p in save_dir.iterdir() if p.name.startswith(".tmp.")]
        out[name] = entry
    return out


def _staged_failures(policy, base: dict, save_dir: Path) -> list[dict]:
    """An injected RuntimeError at each stage of a save; what a loader sees afterwards."""
    from megatron_rl.checkpoint import layout

    set_weights_to_step(policy, base, 1)
    save_checkpoint(policy, str(save_dir), {"step": 1})
    out = []
    for i, stage in enumerate(layout.FAULT_STAGES):
        step = i + 2
        set_weights_to_step(policy, base, step)
        os.environ[layout.FAULT_ENV] = f"{stage}:raise"
        try:
            save_checkpoint(policy, str(save_dir), {"step": step})
            raised = False
        except RuntimeError:
            raised = True
        finally:
            del os.environ[layout.FAULT_ENV]
        state = load_checkpoint(policy, str(save_dir))
        out.append({"stage": stage, "saving": step, "raised": raised, "loaded": state["step"],
                    "weights_ok": _weights_match_step(policy, base, state["step"])})
    return out


def _deadline_check(policy, base: dict, save_dir: Path) -> dict:
    from megatron_rl.checkpoint import layout
    from megatron_rl.checkpoint.dist import parts_of, save_parts

    set_weights_to_step(policy, base, 1)
    save_checkpoint(policy, str(save_dir), {"step": 1})
    set_weights_to_step(policy, base, 2)
    os.environ[layout.FAULT_ENV] = "shards_written:sleep"  # a save that never finishes
    start = time.monotonic()
    try:
        save_parts(parts_of(policy), save_dir, {"step": 2}, timeout_s=1.5)
        error = None
    except TimeoutError as err:
        error = str(err)
    finally:
        del os.environ[layout.FAULT_ENV]
    elapsed = time.monotonic() - start
    state = load_checkpoint(policy, str(save_dir))
    return {"error": error, "elapsed": elapsed, "loaded": state["step"],
            "weights_ok": _weights_match_step(policy, base, 1)}


def _value_error(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _corrupt_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    return dst


def _bad_input_checks(policy, groups, base: dict, root: Path) -> dict:
    from megatron_rl.checkpoint import layout
    from megatron_rl.model.policy import MegatronPolicy

    good_dir = root / "good"
    set_weights_to_step(policy, base, 1)
    good = Path(save_checkpoint(policy, str(good_dir), {"step": 1}))
    (root / "empty").mkdir()
    set_weights_to_step(policy, base, 77)  # sentinel: a failed load must leave these weights
    out = {
        "missing": _value_error(lambda: load_checkpoint(policy, str(root / "nope"))),
        "empty": _value_error(lambda: load_checkpoint(policy, str(root / "empty"))),
        "flipped": _value_error(lambda: load_checkpoint(policy, str(_corrupt_copy(good, root / "flip", "flip")))),
        "truncated": _value_error(lambda: load_checkpoint(policy, str(_corrupt_copy(good, root / "trunc", "cut")))),
        "bad_step": _value_error(lambda: save_checkpoint(policy, str(root / "s"), {"step": "7"})),
        "not_json": _value_error(lambda: save_checkpoint(policy, str(root / "s"), {"step": 7, "x": object()})),
    }
    (root / "nomanifest").mkdir()
    shutil.copytree(good, root / "nomanifest" / "step_00000001")
    (root / "nomanifest" / "step_00000001" / layout.MANIFEST_FILE).unlink()
    out["no_manifest"] = _value_error(lambda: load_checkpoint(policy, str(root / "nomanifest")))
    out["untouched"] = _weights_match_step(policy, base, 77)
    out["nothing_written"] = not (root / "s").exists()
    other = MegatronPolicy(make_config(hidden=32), groups)
    out["other_shape"] = _value_error(lambda: load_checkpoint(other, str(good_dir)))
    return out


def _crash_child(rank: int, world_size: int, killed: dict[str, str], root: str) -> dict:
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    root = Path(root)
    config = make_config(keep_last=2)
    groups = initialize_distributed(config.parallel, seed=config.seed)
    policy = MegatronPolicy(config, groups)
    base = local_weights(policy)  # the workers' initial weights too: same config and seed
    return {
        "killed": _killed_checks(policy, base, killed),
        "staged": _staged_failures(policy, base, root / "staged"),
        "deadline": _deadline_check(policy, base, root / "deadline"),
        "bad": _bad_input_checks(policy, groups, base, root / "bad"),
    }


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_crash")
    killed = _run_killed_workers(root / "killed")
    return run_ranks(1, _crash_child, killed, str(root / "inproc"), timeout=600)[0]


# ---------------------------------------------------------------------- tests


@pytest.mark.multirank
@pytest.mark.parametrize("name", [*STALLED, "random"])
def test_sigkill_leaves_a_complete_checkpoint(crash, name):
    entry = crash["killed"][name]
    assert entry["weights_ok"], entry  # weights agree with the trainer state: no mix of two saves
    assert entry["resolved"] == f"step_{entry['step']:08d}"
    if name == "shards_written":
        assert entry["step"] == 2 and entry["leftovers"] == [".tmp.step_00000003"]
    elif name == "renamed":
        assert entry["step"] == 2 and entry["leftovers"] == []  # step_3 is complete, but latest was not moved
    else:
        assert entry["step"] >= 2
    assert entry["after_new_save"] == "step_00000100" and entry["tmp_after_new_save"] == []


@pytest.mark.multirank
def test_failure_at_every_stage_keeps_a_loadable_checkpoint(crash):
    for entry in crash["staged"]:
        assert entry["raised"], entry
        expected = entry["saving"] if entry["stage"] == "latest_written" else 1
        assert entry["loaded"] == expected and entry["weights_ok"], entry


@pytest.mark.multirank
def test_save_deadline(crash):
    entry = crash["deadline"]
    assert entry["error"] and "save_timeout_s" in entry["error"], entry
    assert entry["elapsed"] < 30 and entry["loaded"] == 1 and entry["weights_ok"]


@pytest.mark.multirank
def test_bad_input_is_a_value_error_and_overwrites_nothing(crash):
    bad = crash["bad"]
    assert "does not exist" in bad["missing"]
    assert "no complete checkpoint" in bad["empty"]
    assert "corrupt" in bad["flipped"] and "CRC32" in bad["flipped"]
    assert "corrupt" in bad["truncated"] and "size" in bad["truncated"]
    assert "no complete checkpoint" in bad["no_manifest"]
    assert "hidden_size: checkpoint 64 vs config 32" in bad["other_shape"]
    assert "trainer_state['step']='7'" in bad["bad_step"]
    assert "JSON-serializable" in bad["not_json"]
    assert bad["untouched"] and bad["nothing_written"]
