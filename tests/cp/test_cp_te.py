"""GPU + TransformerEngine: the TE spec's own context-parallel attention, fed the ``cu_seqlens_*_padded`` that
``CPLocalPack.packed_seq_params`` sets, gives the CP1 log-probs (bf16 tolerance). Skips without 2 CUDA GPUs and
TransformerEngine (never runs on the CPU box)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.cp_helpers import batch_tensors, init, make_batch, make_config
from tests.support.multirank import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]

BF16_TOL = 5e-2
"""bf16 log-probs of O(1) magnitude through 2 layers, two attention kernels (TE CP ring vs TE): a few bf16 ulps;
a wrong chunk layout or position moves them by O(1)."""


def _te_rank(rank, world_size, cp, tensors, full_sd):
    from megatron_rl.model.policy import MegatronPolicy

    cfg = make_config(cp=cp)
    cfg.model.attention_backend, cfg.model.params_dtype = "te", "bfloat16"
    cfg.parallel.device = "cuda"
    groups = init(cfg)
    policy = MegatronPolicy(cfg, groups)
    if full_sd is not None:
        policy.load_full_state_dict(full_sd)
    out = policy.forward(make_batch(tensors))["logprobs"]
    return {"logprobs": out, "full_sd": policy.full_state_dict() if full_sd is None else None}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or importlib.util.find_spec("transformer_engine") is None,
                    reason="needs 2 CUDA GPUs and TransformerEngine")  # fmt: skip
def test_te_cp2_matches_cp1():
    tensors = batch_tensors()
    ref = run_ranks(1, _te_rank, 1, tensors, None, cpu_only=False, timeout=600)[0]
    for res in run_ranks(2, _te_rank, 2, tensors, ref["full_sd"], cpu_only=False, timeout=600):
        assert float((res["logprobs"] - ref["logprobs"]).abs().max()) < BF16_TOL
