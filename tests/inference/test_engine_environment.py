"""What a CPU engine's environment adds to the trainer's (``inference/vllm/server.py: engine_environment``): OpenMP's idle
threads sleep (W47) and vLLM's few ``torch.compile``d sampler helpers run eagerly (W48: compiling them cost every
engine 4-14 s at its first request); a value the user set wins, and a GPU engine gets neither."""

from __future__ import annotations

import pytest

from megatron_rl.inference.vllm.server import engine_environment

ADDED = {"OMP_WAIT_POLICY": "PASSIVE", "TORCHDYNAMO_DISABLE": "1"}


@pytest.mark.parametrize("name", sorted(ADDED))
def test_a_cpu_engine_gets_the_setting_unless_the_user_chose(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert engine_environment()[name] == ADDED[name]
    assert name not in engine_environment(devices="0")
    monkeypatch.setenv(name, "user's")
    assert engine_environment()[name] == "user's"
