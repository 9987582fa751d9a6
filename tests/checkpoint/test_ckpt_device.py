"""Checkpoints do not depend on where the model lives (docs/DESIGN.md section 11): saved on CUDA, loaded on CPU,
and back, bitwise; RNG files with CUDA states load where there is none (and the other way round).

The CPU half of each round trip runs everywhere (``test_rng_state_loads_without_the_saving_device``); the CUDA
round trip is ``gpu``-marked. One rank each: a checkpoint's device independence does not depend on the layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.ckpt_helpers import full_weights, make_batch, make_config, train_step
from tests.support.multirank import run_ranks


def _save_or_load_child(rank: int, world_size: int, device: str, load_from: str | None, save_to: str) -> dict:
    """Build a policy on ``device``; load ``load_from`` (model, optimizer, RNG) if given; weights after the
    load; one Adam step (the loaded optimizer state works here); save to ``save_to``; weights after the step."""
    import dataclasses

    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    config = make_config()
    config.parallel = dataclasses.replace(config.parallel, device=device)
    groups = initialize_distributed(config.parallel, seed=config.seed)
    policy = MegatronPolicy(config, groups)
    state = load_checkpoint(policy, Path(load_from)) if load_from else {"step": 0}
    loaded = full_weights(policy)
    metrics = train_step(policy, make_batch())
    save_checkpoint(policy, Path(save_to), {"step": int(state["step"]) + 1})
    return {"device": str(groups.device), "loaded": loaded, "after": full_weights(policy), "loss": metrics["loss"]}


@pytest.mark.gpu
def test_cuda_checkpoint_loads_on_cpu_and_back_bitwise(tmp_path: Path) -> None:
    on_cuda = run_ranks(1, _save_or_load_child, "cuda", None, str(tmp_path / "a"), timeout=300, cpu_only=False)[0]
    on_cpu = run_ranks(1, _save_or_load_child, "cpu", str(tmp_path / "a"), str(tmp_path / "b"), timeout=300)[0]
    back = run_ranks(1, _save_or_load_child, "cuda", str(tmp_path / "b"), str(tmp_path / "c"), timeout=300,
                     cpu_only=False)[0]
    assert on_cuda["device"].startswith("cuda") and on_cpu["device"] == "cpu"
    for name, weight in on_cuda["after"].items():
        assert torch.equal(on_cpu["loaded"][name], weight), name  # saved on CUDA, loaded on CPU
        assert torch.equal(back["loaded"][name], on_cpu["after"][name]), name  # saved on CPU, loaded on CUDA
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in (on_cuda, on_cpu, back))


def test_rng_state_loads_without_the_saving_device(monkeypatch) -> None:
    """A file saved on CUDA (CUDA generators, CUDA tracker states) restores the host generators on a CPU-only
    machine and leaves the tracker alone; a CPU file on CUDA restores no CUDA generator."""
    import random

    from megatron.core import tensor_parallel

    from megatron_rl.checkpoint import rng

    saved = rng.capture_rng_state()
    assert saved["tracker_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert all(v.device.type == "cpu" for v in saved["tracker"].values())
    expected_draw = random.random()
    calls = []
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "set_states", lambda s: calls.append(s))
    foreign = dict(saved, tracker_device="cuda" if saved["tracker_device"] == "cpu" else "cpu")
    rng.restore_rng_state(foreign)
    assert random.random() == expected_draw and calls == []  # host generators restored, tracker untouched
    rng.restore_rng_state(saved)
    assert len(calls) == 1
    legacy = {k: v for k, v in saved.items() if k != "tracker_device"}  # files from before the key existed
    rng.restore_rng_state(legacy)
    assert len(calls) == (2 if saved["tracker_device"] == "cpu" else 1)
