"""Bad inputs, table-driven: each fails with the right error type, a message naming the field, and (library
inputs) leaves weights, optimizer state and LR schedule bitwise unchanged. Issue 16 (docs: README "When things
go wrong"). One spawned single-rank process holds the tiny policy for every library case."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multirank import run_ranks
from megatron_rl.config import ConfigError, load_config
from megatron_rl.preflight import check_run

# ------------------------------------------------------------------ config: overrides and YAML files

OVERRIDES = [
    (["optimizer.lr=.inf"], "optimizer.lr"),
    (["optimizer.lr=.nan"], "optimizer.lr"),
    (["optimizer.adam_beta1=1.5"], "optimizer.adam_beta1"),
    (["optimizer.clip_grad=-1"], "optimizer.clip_grad"),
    (["seed=-1"], "seed"),
    (["optimizer.learning_rate=1e-3"], "optimizer.lr"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["checkpoint.resume_fallback=maybe"], "checkpoint.resume_fallback"),
]

YAML_FILES = [
    ("optimizer:\n  lr: [1\n", "invalid YAML at line 3, column 1"),
    ("optimizer: 3\n", "optimizer"),
    ("- a list\n", "mapping"),
]


@pytest.mark.parametrize("overrides, key", OVERRIDES)
def test_bad_override_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("text, needle", YAML_FILES)
def test_bad_yaml_file_names_the_file(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as info:
        load_config(path)
    assert "bad.yaml" in str(info.value) or needle in str(info.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config("nope.yaml")


# ------------------------------------------------------------------ pre-flight: directories, exit code


def _unwritable(tmp_path: Path) -> Path:
    """A directory the run cannot create: under a regular file (root ignores chmod, so no read-only dir)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    return blocker / "checkpoints"


def test_unwritable_checkpoint_dir_is_refused_before_any_rank_starts(tmp_path):
    cfg = load_config(None, [f"logging.output_dir={tmp_path / 'out'}",
                             f"checkpoint.save_dir={_unwritable(tmp_path)}"])
    with pytest.raises(ValueError, match=r"checkpoint\.save_dir=.*a_file/checkpoints.* is not writable"):
        check_run(cfg, world_size=1)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.job.preflight", "--config", "configs/demo_cpu.yaml", "--world-size", "2",
         f"logging.output_dir={tmp_path / 'out'}", f"checkpoint.save_dir={_unwritable(tmp_path)}"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "checkpoint.save_dir" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_dir_is_refused(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    cfg = load_config(None, [f"logging.output_dir={read_only}"])
    with pytest.raises(ValueError, match="logging.output_dir"):
        check_run(cfg, world_size=1)


def test_preflight_checks_the_world_size_and_warns_on_low_space(tmp_path, monkeypatch):
    import shutil

    import megatron_rl.preflight as preflight

    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2", f"logging.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        check_run(cfg, world_size=3)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1))
    with pytest.warns(UserWarning, match="GiB free"):
        assert check_run(cfg, world_size=2)


def test_preflight_refuses_cuda_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="parallel.device='cuda' but no CUDA device is visible"):
        check_run(load_config(None, ["parallel.device=cuda"]), world_size=1)


def _saved_run(save_dir: Path, overrides: list[str], *, critic: bool = False) -> None:
    """What the pre-flight reads of a saved run: ``step_00000007`` with its manifest and config.yaml (no
    weights), and a critic checkpoint directory when the run had one."""
    import dataclasses

    from megatron_rl.checkpoint import layout
    from megatron_rl.config import dump_config

    saved = load_config(None, overrides)
    for directory in [save_dir] + ([save_dir / "critic"] if critic else []):
        ckpt = directory / "step_00000007"
        ckpt.mkdir(parents=True)
        layout.write_manifest(ckpt, {}, {"model": dataclasses.asdict(saved.model)})
        dump_config(saved, ckpt / layout.CONFIG_FILE)
        layout.write_latest(directory, ckpt)


@pytest.mark.parametrize("saved, requested, needles", [
    (["model.hidden_size=64"], ["model.hidden_size=128"], ["model.hidden_size: checkpoint 64 vs config 128"]),
    (["algorithm.advantage_estimator=grpo"], ["algorithm.advantage_estimator=rloo"],
     ["algorithm.advantage_estimator: checkpoint 'grpo' vs config 'rloo'"]),
    ([], ["critic.enabled=true", "critic.lr=1e-3"], ["critic: checkpoint without vs config with"]),
    (["model.freeze_vision=true"], [], ["model.freeze_vision: checkpoint true vs config false"]),
])
def test_preflight_refuses_to_resume_another_run(tmp_path, saved, requested, needles):
    save_dir = tmp_path / "out" / "checkpoints"
    _saved_run(save_dir, saved)
    config = load_config(None, [f"logging.output_dir={tmp_path / 'out'}", *requested])
    with pytest.raises(ConfigError, match="holds another run \\(step_00000007\\)") as info:
        check_run(config, world_size=1)
    assert all(needle in str(info.value) for needle in needles), str(info.value)
    assert "new logging.output_dir" in str(info.value)
    check_run(load_config(None, [f"logging.output_dir={tmp_path / 'out'}", *saved]), world_size=1)  # same run: ok
    check_run(dataclasses_replace_resume_off(config), world_size=1)  # no resume: nothing to compare


def dataclasses_replace_resume_off(config):
    import dataclasses

    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=False))


def test_preflight_names_the_resolved_output_dir(tmp_path):
    """The launcher's second line: the output directory of the config as used (overrides included)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.job.preflight", "--config", "configs/demo_cpu.yaml", "--world-size", "2",
         f"logging.output_dir={tmp_path / 'mine'}"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"megatron_rl pre-flight: ok; outputs go to {tmp_path / 'mine'} "
                                        f"(logging.output_dir), checkpoints to {tmp_path / 'mine' / 'checkpoints'}"]


# ------------------------------------------------------------------ library inputs on a real policy


def _valid_rollouts() -> dict:
    return {
        "prompt_token_ids": [[1, 2], [1, 2], [3, 4], [3, 4]],
        "response_ids": [[5, 6], [7], [8, 9], [10]],
        "rewards": [1.0, 0.0, 0.5, [0.0]],
        "loss_masks": [[1, 1], [1], [1, 0], [1]],
        "rollout_logprobs": [[-0.5, -0.6], [-0.7], [-0.1, -0.2], [-0.3]],
        "uids": ["a", "a", "b", "b"],
    }


def _set(field, index, value):
    def change(out):
        out[field][index] = value
        return out

    return change


LIBRARY = [
    ("none_row", _set("response_ids", 1, None), "response_ids"),
    ("not_mapping", lambda out: list(out.values()), "mapping"),
    ("unhashable_uid", _set("uids", 0, {"a": 1}), "uids"),
    ("positive_logprob", _set("rollout_logprobs", 2, [-0.1, 0.3]), "rollout_logprobs"),
    ("unknown_key", lambda out: {**out, "advantages": [[1.0, 1.0], [1.0], [1.0, 1.0], [1.0]]}, "advantages"),
    ("nan_reward", _set("rewards", 0, float("nan")), "rewards"),
    ("inf_token_reward", _set("rewards", 3, [float("inf")]), "rewards"),
    ("string_reward", _set("rewards", 1, "1.0"), "rewards"),
    ("ragged_mask", _set("loss_masks", 0, [1]), "loss_masks"),
    ("empty_response", _set("response_ids", 3, []), "response_ids"),
]


def _state(policy) -> bytes:
    """Weights, optimizer state and LR schedule, serialized: equal bytes = bitwise the same state."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"weights": policy.module.state_dict(), "optimizer": policy.optimizer.state_dict(),
                "scheduler": policy.scheduler.state_dict()}, buffer)
    return buffer.getvalue()


def _same(a: bytes, b: bytes) -> bool:
    return a == b


def _library_child(rank: int, world_size: int) -> dict:
    import torch

    from megatron_rl.config import ModelConfig, MegatronRLConfig, OptimizerConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    cfg = MegatronRLConfig(model=ModelConfig(attention_backend="local", vocab_size=16),
                           optimizer=OptimizerConfig(lr=0.01))
    policy = MegatronPolicy(cfg, initialize_distributed(cfg.parallel, seed=cfg.seed))
    trainer = Trainer(cfg, policy)
    trainer.train_step(_valid_rollouts())  # a stepped optimizer: its state is not trivially zero
    results = {}
    for name, change, _ in LIBRARY:
        before = _state(policy)
        try:
            trainer.train_step(change(copy.deepcopy(_valid_rollouts())))
            results[name] = ("no error", "", _same(before, _state(policy)))
        except Exception as err:  # noqa: BLE001 - the test checks the type
            results[name] = (type(err).__name__, str(err), _same(before, _state(policy)))
    # valid data as tensors (one requiring grad) and arrays is accepted
    out = _valid_rollouts()
    out["rewards"] = [torch.tensor(1.0, requires_grad=True), 0.0, torch.tensor(0.5), [0.0]]
    out["rollout_logprobs"][0] = torch.tensor([-0.5, -0.6], requires_grad=True)
    results["tensors_accepted"] = sorted(trainer.train_step(out))[:1]
    return results


@pytest.fixture(scope="module")
def library():
    return run_ranks(1, _library_child, timeout=600)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name, change, field", LIBRARY, ids=[c[0] for c in LIBRARY])
def test_bad_library_input_is_a_value_error_and_changes_nothing(library, name, change, field):
    kind, message, unchanged = library[name]
    assert kind == "ValueError", (name, kind, message)
    assert field in message, message
    assert unchanged, f"{name}: weights, optimizer state or LR schedule changed"


@pytest.mark.multirank
def test_valid_tensors_are_accepted(library):
    assert library["tensors_accepted"]
