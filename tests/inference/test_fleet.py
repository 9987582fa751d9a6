"""A fleet of two real ``vllm serve`` engines (``fleet_trainer.py`` runs every check against the same servers):
only the job's token opens any route, engines listen on loopback, and an engine that dies, hangs or all of them
dying costs a restart, not the call: the samples stay those of the healthy fleet (the same per-sample seeds on
another engine; log-probs within 1e-4, the fp32 engine-vs-engine noise bound of test_vllm_sync.py), and a
replacement serves only with the trainer's current weights (its digests equal the other engine's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.fleet]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fleet_result(engine_hf_model, engine_py, tmp_path_factory) -> dict:
    env = {**os.environ, "MEGATRON_RL_ENGINE_PYTHON": engine_py, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    work = tmp_path_factory.mktemp("fleet")
    done = subprocess.run([sys.executable, "-m", "tests.support.fleet_trainer", str(engine_hf_model), str(work)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_route_needs_the_token_and_engines_listen_on_loopback(fleet_result):
    for route, (no_token, wrong_token) in fleet_result["auth"].items():
        assert no_token == 401 and wrong_token == 401, (route, no_token, wrong_token)
    assert fleet_result["bind"] == ["127.0.0.1", "127.0.0.1"]


def test_same_call_same_samples(fleet_result):
    assert fleet_result["repeat_equal"]
    grouped = fleet_result["grouped"]  # one request per group, each sample the one its own request draws
    assert grouped["requests"] == [4, 4, 4, 4]
    assert grouped["same"]
    assert fleet_result["start_metrics"] == {"rollout/engine_restarts": 0.0, "rollout/engines_alive": 2.0}


def test_a_step_of_any_size_and_quiet_logs(fleet_result):
    assert fleet_result["big_step"] == [8] * 32
    assert fleet_result["bad_token"] == ("prompt 1 has token ids [256]: token ids must be in [0, 256) "
                                         "(model.vocab_size) and a prompt needs at least one")
    assert fleet_result["quiet_logs"] == {"engine0.log": [], "engine1.log": []}


def test_a_killed_engine_costs_a_restart_not_the_call(fleet_result):
    kill = fleet_result["after_kill"]
    assert kill["same"]
    assert kill["metrics"] == {"rollout/engine_restarts": 1.0, "rollout/engines_alive": 1.0}
    assert kill["synced"]["metrics"]["rollout/engines_alive"] == 2.0
    assert kill["synced"]["digests_equal"] and kill["synced"]["tensors"] == 25


def test_an_engine_killed_just_before_a_sync_costs_a_restart_not_the_sync(fleet_result):
    killed = fleet_result["killed_before_sync"]
    assert killed["metrics"] == {"rollout/engine_restarts": 1.0, "rollout/engines_alive": 1.0}
    assert killed["state"] == "starting"
    assert len(killed["tokens"]) == 16  # the survivor serves the next call alone


def test_a_hung_engine_is_replaced(fleet_result):
    hang = fleet_result["after_hang"]
    assert hang["same"] and hang["metrics"]["rollout/engine_restarts"] == 1.0
    assert hang["seconds"] < 15 + 60  # request_timeout_s + the progress probe, not the socket timeouts


def test_all_engines_down_waits_for_replacements_with_current_weights(fleet_result):
    down = fleet_result["after_all_down"]
    assert down["metrics"]["rollout/engine_restarts"] == 2.0
    assert down["logprob_abs_diff_max"] <= 1e-4  # the replacement samples from the trainer's current weights


def test_no_engine_outlives_the_trainer(fleet_result):
    for pid in fleet_result["pids"]:  # each server led its own process group
        alive = [p for p in Path("/proc").glob("[0-9]*/stat")
                 if _pgid(p) == pid and p.read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not alive, f"processes of engine group {pid} outlived the trainer"


def _pgid(stat: Path) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return -1
