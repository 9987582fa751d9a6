"""``distillation.teachers[i].offload: true``: the teacher's weights sleep in host memory between scoring passes
(``distillation/offload.py``). One process, gloo, ~15 s (a spawn); on CUDA (``gpu``) also its device memory.

Checked: an offloaded teacher's log-probs are bitwise the resident teacher's, and a whole distillation step with
it gives the resident run's loss and grad norm, for ``reverse_kl`` and for ``full_kl`` (whose update runs the
teacher: awake from the term's ``prepare`` to its ``close``); between passes every parameter's storage is the host copy and a
failing forward still puts it back to sleep; on a GPU the teacher holds no device memory between passes and its
scores are the resident ones. Planted bug checked by hand: ``sleep`` that keeps the device copies fails the GPU
test's memory check (it cannot fail on CPU, where host and device are one memory).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distill.test_distill_multirank import _config, _rollouts
from tests.support.multirank import run_ranks

pytestmark = pytest.mark.slow  # spawns a rank


def _scores(cfg, groups) -> tuple[torch.Tensor, dict, object]:
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distillation.signal import TEACHER_LOGPROBS
    from megatron_rl.distillation.teachers import build_distillation

    distillation = build_distillation(cfg, groups, pad_token_id=0)
    batch = TrainingBatch.from_generator_output(_rollouts(), pad_token_id=0)
    distillation.score(batch)
    return batch[TEACHER_LOGPROBS.format(name="t")], distillation


def _rank(rank, world_size, teacher_dir, device):
    from megatron_rl.distillation.config import DistillationConfig
    from megatron_rl.distillation.teachers import build_distillation
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    cfg = _config(teacher_dir)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, device=device))
    offloaded_cfg = dataclasses.replace(cfg, distillation=DistillationConfig(
        teachers=[{"name": "t", "hf_path": teacher_dir, "offload": True}], coef=cfg.distillation.coef))
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    out = {}
    resident, _ = _scores(cfg, groups)
    cuda = groups.device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    offloaded, distillation = _scores(offloaded_cfg, groups)
    teacher = distillation.teachers[0]
    out["teacher_mib_asleep"] = (torch.cuda.memory_allocated() - before) / 2**20 if cuda else 0.0
    out["asleep"] = all(p.data.data_ptr() == h.data_ptr() for p, h in zip(teacher.params, teacher.host))
    out["on_host"] = all(p.device.type == "cpu" for p in teacher.params)
    try:
        with teacher.awake():
            raise RuntimeError("a forward that fails")
    except RuntimeError:
        out["asleep_after_error"] = all(p.data.data_ptr() == h.data_ptr() for p, h in zip(teacher.params, teacher.host))
    out["equal"] = torch.equal(resident, offloaded)
    out["teacher_mib"] = sum(p.numel() * p.element_size() for p in teacher.params) / 2**20
    steps = {}
    full = {name: dataclasses.replace(c, distillation=dataclasses.replace(c.distillation, kind="full_kl"))
            for name, c in (("resident", cfg), ("offloaded", offloaded_cfg))}  # the teacher inside the update
    for name, c in (("resident", cfg), ("offloaded", offloaded_cfg), ("resident_full", full["resident"]),
                    ("offloaded_full", full["offloaded"])):
        torch.manual_seed(0)
        policy = MegatronPolicy(c, groups, pad_token_id=0)
        dist = build_distillation(c, groups, pad_token_id=0)
        steps[name] = Trainer(c, policy, distillation=dist).train_step(_rollouts())
        if name == "offloaded_full":
            out["asleep_after_full_kl"] = all(p.data.data_ptr() == h.data_ptr()
                                              for p, h in zip(dist.teachers[0].params, dist.teachers[0].host))
    out["steps"] = steps
    return out


def _check(out: dict) -> None:
    assert out["equal"] and out["asleep"] and out["on_host"] and out["asleep_after_error"]
    assert out["asleep_after_full_kl"]
    for key in ("policy/pg_loss", "optim/grad_norm", "distill/t/reverse_kl"):
        assert out["steps"]["offloaded"][key] == out["steps"]["resident"][key], key
    for key in ("policy/pg_loss", "optim/grad_norm", "distill/t/full_kl"):
        assert out["steps"]["offloaded_full"][key] == out["steps"]["resident_full"][key], key
    assert out["steps"]["resident_full"]["distill/t/full_kl"] > 0


def test_an_offloaded_teacher_scores_bitwise_like_a_resident_one(teacher_dir):
    _check(run_ranks(1, _rank, str(teacher_dir), "cpu", timeout=300)[0])


@pytest.mark.gpu
def test_an_offloaded_teacher_holds_no_device_memory_between_passes(teacher_dir):
    out = run_ranks(1, _rank, str(teacher_dir), "cuda", timeout=300)[0]
    _check(out)
    assert out["teacher_mib_asleep"] < 0.05 * out["teacher_mib"], out
