"""Host syncs per train step, counted on CPU (issue 53: the first H100 step was host-bound, ~1,200 ``.item()``).

A counter wraps ``Tensor.item / tolist / cpu / __float__ / __int__ / __bool__`` (each one a device-to-host sync
when the tensor is on a GPU) and records the megatron_rl line that called it directly (megatron-core's and torch's
own calls are theirs), during one ``Trainer.train_step``
of a single-process policy. Sites that work on host tensors by design (the batch is planned and packed on the
host; ``_partial`` converts only CPU tensors) are named in ``HOST_SIDE`` with the reason. The claim: what is left
does not grow with the number of micro-batches (the same step in 6 micro-batches and in 1 makes the same syncs),
and stays within ``PER_STEP``. Before issue 53 the rollout-mismatch and importance-ratio metrics of every
micro-batch (``trainer.policy_loss_with_rollout_metrics``) made 6 counted syncs and 3 ``.to("cpu")`` copies each:
restoring one of them (the guard ``bool(loss_mask.any())``) fails the first assertion (checked by hand). ~10 s of
CPU (two policies, two steps each).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from tests.test_trainer_skip import MODEL, rollouts

from megatron_rl.config import load_config
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
OURS = str(ROOT / "megatron_rl") + "/"
SYNCS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")
HOST_SIDE = {
    "megatron_rl/metrics.py": "_partial: float() of CPU tensors only (a GPU partial stays on the device)",
    "megatron_rl/data/packing.py": "packing runs on the host batch (model/plan.py)",
    "megatron_rl/data/batch.py": "the host TrainingBatch",
    "megatron_rl/model/plan.py": "planning runs on the host batch before any copy to the device",
    "megatron_rl/model/attention.py": "the local (CPU) attention's host bounds; GPUs run TransformerEngine's",
    "megatron_rl/trainer.py:rollout_metrics": "the host batch's rewards and lengths",
    "megatron_rl/trainer.py:zero_advantage_metrics": "the host batch's rewards per group",
}
PER_STEP = 3  # measured: the advantages' max, the mini-batch's token count for normalization and for the loss
BATCH = ["batch.train_batch_size=2", "batch.policy_mini_batch_size=2", "batch.update_epochs_per_batch=1",
         "optimizer.optimizer=adam", "optimizer.lr=0.01", "optimizer.lr_warmup_steps=0"]


class SyncCounter:
    """Counts the wrapped Tensor methods by the megatron_rl line (file:function:line) that called them."""

    def __init__(self) -> None:
        self.sites: collections.Counter = collections.Counter()
        self.active = False

    def __enter__(self) -> SyncCounter:
        self.saved = {name: getattr(torch.Tensor, name) for name in SYNCS}
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            if self.active and frame.f_code.co_filename.startswith(OURS):  # megatron_rl's own calls
                path = Path(frame.f_code.co_filename).relative_to(ROOT).as_posix()
                self.sites[f"{path}:{frame.f_code.co_name}:{frame.f_lineno} {name}"] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def device_side(self) -> dict[str, int]:
        return {site: n for site, n in self.sites.items() if not any(site.startswith(k + ":") for k in HOST_SIDE)}


def _syncs_of_one_step(rule: list[str]) -> SyncCounter:
    from megatron_rl.model.policy import MegatronPolicy

    config = load_config(None, [*MODEL, *BATCH, *rule])
    trainer = Trainer(config, MegatronPolicy(config, GROUPS[0], pad_token_id=0, total_optim_steps=4),
                      skip_old_logprobs=True)
    trainer.train_step(rollouts())  # warm-up: lazy state (Adam moments, caches)
    with SyncCounter() as counter:
        counter.active = True
        trainer.train_step(rollouts())
    return counter


GROUPS: list = []


@pytest.fixture(scope="module", autouse=True)
def _groups():
    GROUPS.append(initialize_distributed(load_config(None, MODEL).parallel, seed=7))
    yield
    destroy_distributed()
    GROUPS.clear()


def test_host_syncs_do_not_grow_with_micro_batches():
    six = _syncs_of_one_step(["batch.micro_batch_size=1"])
    one = _syncs_of_one_step(["batch.micro_batch_size=null", "batch.max_tokens_per_micro_batch=auto"])
    assert six.device_side() == one.device_side(), f"per micro-batch syncs: {six.device_side()} vs 1: {one.device_side()}"
    total = sum(six.device_side().values())
    assert total <= PER_STEP, f"{total} host syncs per step (at most {PER_STEP}): {six.device_side()}"
