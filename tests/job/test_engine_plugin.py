"""An engine of one's own trains the main job with no library edit: ``RecordingEngine`` below wraps the built-in
engine and records every call of the engine contract (``inference/engine.py: RolloutEngine``); this file registers
it through the public hook (``inference/registry.py: register_engine``), and ``bash run_megatron.sh
rollout.engine_module=<this file> rollout.engine=recording`` trains with it: every process that reads the config
(the pre-flight, each rank) imports this file, which registers the engine there (docs/INFERENCE.md section 7).

It declares its own weights (``own_weights``), so the job syncs it every step and logs its ``last_sync_bytes``
and ``step_metrics``: the metrics show that the job went through the contract, not around it.

Cost: the main-job run, DP2 on CPU, 2 steps of the digit game (~25 s on the 2-core machine); the config checks
~0.1 s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_rl.inference.engine import EngineCapabilities
from megatron_rl.inference.registry import ENGINES, register_engine

NAME = "recording"
SYNC_BYTES = 1234
"""What the engine says each sync moved (``last_sync_bytes``): the job must log it as ``rollout/weight_sync_bytes``."""
CAPABILITIES = EngineCapabilities(own_weights=True)


class RecordingEngine:
    """The built-in engine, plus a record of every call (rank 0 writes it to ``<output_dir>/engine_calls.json``
    when closed)."""

    capabilities = CAPABILITIES
    run_on_main_thread = None
    agent_calls = None

    def __init__(self, inner, record_to: Path | None) -> None:
        self.inner, self.record_to = inner, record_to
        self.calls: list[list] = [["start"]]
        self.version = 0
        self.last_sync_bytes = 0
        self.generated_since_metrics = 0

    def generate(self, prompts, spec, *, seed):
        self.calls.append(["generate", len(prompts), seed])
        self.generated_since_metrics += len(prompts)
        return self.inner.generate(prompts, spec, seed=seed)

    def update_weights(self, policy) -> float:
        self.version += 1
        self.last_sync_bytes = SYNC_BYTES
        self.calls.append(["update_weights", self.version])
        return self.inner.update_weights(policy)  # the built-in engine samples from the live policy: nothing to do

    def step_metrics(self) -> dict[str, float]:
        count, self.generated_since_metrics = self.generated_since_metrics, 0
        return {"rollout/recorded_prompts": float(count)}

    def close(self) -> None:
        if self.record_to is None or self.calls[-1] == ["close"]:
            return
        self.calls.append(["close"])
        tmp = self.record_to.with_name(f".tmp.{self.record_to.name}")
        tmp.write_text(json.dumps(self.calls))
        os.replace(tmp, self.record_to)


def start_recording(config, policy, *, pad_token_id: int) -> RecordingEngine:
    """The factory ``register_engine`` takes: the job's config, the policy, the pad id; collective."""
    from megatron_rl.inference.builtin_engine import BuiltinEngine

    record_to = Path(config.rl.logging.output_dir) / "engine_calls.json" if policy.groups.rank == 0 else None
    return RecordingEngine(BuiltinEngine.from_policy(policy, pad_token_id), record_to)


if NAME not in ENGINES:  # (imported twice in one process: by pytest, and by a config naming this file)
    register_engine(NAME, start_recording, capabilities=CAPABILITIES)


@pytest.mark.multirank
def test_an_engine_registered_in_a_test_file_trains_the_main_job(tmp_path):
    from tests.support.job_run import metric_rows, run_megatron

    out = tmp_path / "out"
    proc = run_megatron(f"rollout.engine_module={Path(__file__).resolve()}", f"rollout.engine={NAME}",
                        "job.num_steps=2", "checkpoint.save_interval=0", "eval.interval=0",
                        f"logging.output_dir={out}", "logging.progress_bar=false")
    assert "vLLM" not in proc.stdout
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/weight_sync_bytes"] == SYNC_BYTES and r["rollout/recorded_prompts"] > 0 for r in rows)
    calls = json.loads((out / "engine_calls.json").read_text())
    kinds = [c[0] for c in calls]
    assert kinds[0] == "start" and kinds[-1] == "close"
    syncs = [i for i, kind in enumerate(kinds) if kind == "update_weights"]
    assert [calls[i][1] for i in syncs] == [1, 2]  # one sync per step (rollout.sync_interval=1) ...
    assert "generate" in kinds[1:syncs[0]] and "generate" in kinds[syncs[0]:syncs[1]]  # ... after its rollouts
    import yaml

    written = yaml.safe_load((out / "config.yaml").read_text())["rollout"]
    assert written["engine"] == NAME and written["engine_module"] == str(Path(__file__).resolve())


def test_the_engine_key_takes_registered_names_and_lists_them_otherwise(tmp_path, monkeypatch):
    """``rollout.engine`` is looked up in the registry after importing ``rollout.engine_module`` (a path relative
    to the caller's directory); an unknown name is a ConfigError that lists the registered ones."""
    from megatron_rl.config import ConfigError
    from megatron_rl.job.config import load_job_config

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"

    with pytest.raises(ConfigError, match=r"rollout.engine='nope' is not one of the registered engines \[.*'builtin'"
                                          r".*'vllm'.*\] \(an engine of your own: rollout.engine_module="):
        load_job_config(demo, ["rollout.engine=nope"])
    (tmp_path / "engine_file.py").write_text(
        "from megatron_rl.inference.engine import EngineCapabilities\n"
        "from megatron_rl.inference.registry import register_engine\n"
        "register_engine('from_file', lambda config, policy, *, pad_token_id: None, "
        "capabilities=EngineCapabilities())\n")
    monkeypatch.chdir(tmp_path)
    config = load_job_config(demo, ["rollout.engine_module=engine_file.py", "rollout.engine=from_file"])
    assert config.rollout.engine_module == str(tmp_path / "engine_file.py")
    with pytest.raises(ConfigError, match="rollout.partial_rollouts=true pauses .* rollout.engine=from_file"):
        load_job_config(demo, ["rollout.engine_module=engine_file.py", "rollout.engine=from_file",
                               "rollout.partial_rollouts=true", "rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"rollout.engine_module='.*missing.py': '.*missing.py' is not a file"):
        load_job_config(demo, ["rollout.engine_module=missing.py", "rollout.engine=from_file"])
