"""Where a job's launcher starts its own engine zygote (``inference/vllm/job_zygote.py: wanted``): only for CPU
engines this node starts. That the engines then fork from it, and that nothing outlives a killed job, is
``tests/job/test_vllm_main_job.py`` (its first run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.inference.engine_process.zygote import ZYGOTE_ENV
from megatron_rl.inference.vllm.job_zygote import wanted


def _job(**rollout):
    values = dict(engine="vllm", num_engines=1, engine_nodes=0)
    return SimpleNamespace(rollout=SimpleNamespace(**{**values, **rollout}))


@pytest.mark.parametrize("rollout, env, reason", [
    ({}, {}, None),
    ({"engine": "builtin"}, {}, "no engine of the job's own"),
    ({"num_engines": 0}, {}, "no engine of the job's own"),
    ({}, {ZYGOTE_ENV: "off"}, "is set"),
    ({}, {ZYGOTE_ENV: "/tmp/suite.sock"}, "is set"),
    ({"engine_nodes": 1}, {}, "nodes of their own"),
    ({"num_engines": 2}, {"NODE_RANK": "2"}, "this node starts no engine"),
    ({"num_engines": 2}, {"NODE_RANK": "1"}, None),
])
def test_a_zygote_only_for_the_cpu_engines_this_node_starts(rollout, env, reason, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    found = wanted(_job(**rollout), env)
    assert (found is None) if reason is None else (reason in found), found
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    if reason is None:
        assert "GPU engines" in wanted(_job(**rollout), env)
