"""The fleet's calls without vLLM. An agent's call when no engine serves (``inference/vllm/calls.py: Fleet.complete``): it waits
for the replacement (flagging ``calls_waiting`` for the job's admission), bounded by ``rollout.start_timeout_s``,
and fails at once when none is coming back. The replacement's "is back" line: ``VLLMEngine._admit`` (fleet tests).
A rollout call (``Fleet.generate``) sends one request per group and heals: the groups of an engine that fails go
to another with the same seeds (the real engines' samples: ``test_fleet.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.engine import Completion, SamplingSpec
from megatron_rl.inference.vllm.server import EngineError
from megatron_rl.inference.vllm.fleet import Fleet
from megatron_rl.inference.vllm.slot import Slot

SPEC = SamplingSpec(max_tokens=2, stop_token_ids=(0,))


class AnsweringServer:
    owned = False
    log_path = None
    url = "http://127.0.0.1:1"

    def complete(self, prompt, spec, *, seed, timeout_s, model, versioned):
        return Completion([7, 0], [-0.1, -0.2], "stop")

    def kill(self):  # (``Fleet`` registers ``kill_all`` with atexit)
        pass


def fleet_of(state: str, start_timeout_s: float = 60.0) -> Fleet:
    fleet = Fleet(RolloutConfig(engine="vllm", start_timeout_s=start_timeout_s),
                  SimpleNamespace(work_dir=None, token="t", layout=SimpleNamespace(node=0)))
    fleet.slots = [Slot(index=0, server=AnsweringServer(), state=state)]
    return fleet


@pytest.mark.parametrize("state", ["dead", "starting"])  # dead: marked down, its replacement not launched yet
def test_an_agent_call_waits_for_the_replacement_engine(state):
    fleet = fleet_of(state)

    def replacement_serves() -> None:  # what the job's admission does once the call is flagged
        assert fleet.calls_waiting.wait(timeout=10)
        time.sleep(0.3)
        fleet.slots[0].state = "serving"

    threading.Thread(target=replacement_serves, daemon=True).start()
    started = time.monotonic()
    assert fleet.complete([1, 2], SPEC, seed=3, session="s").token_ids == [7, 0]
    assert time.monotonic() - started >= 0.3


def test_an_agent_call_gives_up_when_no_engine_comes_back():
    given_up = fleet_of("dead")
    given_up.slots[0].error = "its log says why; restarted 3 times already"
    with pytest.raises(EngineError, match="none is coming back"):
        given_up.complete([1, 2], SPEC, seed=3, session="s")
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"none came back within 1 s \(rollout.start_timeout_s=0.5\)"):
        fleet_of("starting", start_timeout_s=0.5).complete([1, 2], SPEC, seed=3, session="s")
    assert time.monotonic() - started < 5


def test_the_admission_waits_for_a_replacement_marked_down_but_not_launched_yet():
    """``mark_down`` sets 'dead', kills the old server (a forked one's exit is polled through the zygote), then
    launches: an agent call that fails meanwhile flags the admission, which must wait, not end the run (CI: "no vLLM
    engine is serving and none could be brought back" in test_agent_job's lost-engine test)."""
    fleet = fleet_of("dead")

    def launched_and_up() -> None:
        time.sleep(0.3)
        fleet.slots[0].state = "starting"
        time.sleep(0.3)
        fleet.slots[0].state = "joining"

    threading.Thread(target=launched_and_up, daemon=True).start()
    assert fleet.wait_for_replacement() == fleet.slots[:1]


def test_a_replacement_that_cannot_be_launched_ends_the_wait_with_the_reason():
    def launch(index):
        raise FileNotFoundError("[Errno 2] No such file or directory: '/gone/python'")

    fleet = Fleet(RolloutConfig(engine="vllm"), SimpleNamespace(
        work_dir=None, token="t", layout=SimpleNamespace(node=0), launch=launch))
    fleet.slots = [Slot(index=0, server=DyingServer([]), state="serving")]
    fleet.mark_down(fleet.slots[0], "POST /v1/completions: ConnectionResetError")
    with pytest.raises(EngineError, match="its replacement could not be launched: .*No such file"):
        fleet.wait_for_replacement()


class SeededServer(AnsweringServer):
    """Sample ``k`` of a request is ``[seed + k]``, as vLLM seeds it; ``fail`` raises EngineDown instead."""

    def __init__(self, requests: list, fail: bool = False):
        self.requests, self.fail = requests, fail

    def sample(self, prompt, spec, *, seed, n, timeout_s, versioned, model=None):
        from megatron_rl.inference.vllm.server import EngineDown

        self.requests.append((self, n))
        if self.fail:
            raise EngineDown("POST /v1/completions: ConnectionResetError")
        return [Completion([seed + k], [-0.5], "length") for k in range(n)]


def test_a_rollout_call_sends_one_request_per_group_and_heals(monkeypatch):
    sent: list = []
    fleet = fleet_of("serving")
    healthy, failing = SeededServer(sent), SeededServer(sent, fail=True)
    fleet.slots = [Slot(index=0, server=healthy, state="serving"), Slot(index=1, server=failing, state="serving")]
    monkeypatch.setattr(fleet, "mark_down", lambda slot, reason: setattr(slot, "state", "dead"))
    prompts = [[1, 2]] * 4 + [[3]] * 4
    completions = fleet.generate(prompts, SamplingSpec(max_tokens=1), list(range(50, 58)))
    assert [c.token_ids for c in completions] == [[s] for s in range(50, 58)]  # the seeds' samples, healed
    assert sorted((server is healthy, n) for server, n in sent) == [(False, 4), (True, 4), (True, 4)]
    assert fleet.slots[1].state == "dead"


class DyingServer(SeededServer):
    """Dies on every request (a request that kills the engine, e.g. an attention layout it cannot run)."""

    owned = True

    def __init__(self, requests: list):
        super().__init__(requests, fail=True)

    def wait_ready(self, timeout_s, what=""):
        return {}


def test_a_request_that_kills_every_replacement_stops_after_max_restarts():
    from megatron_rl.inference.vllm.slot import MAX_RESTARTS

    sent: list = []
    fleet = Fleet(RolloutConfig(engine="vllm"), SimpleNamespace(
        work_dir=None, token="t", layout=SimpleNamespace(node=0), launch=lambda index: DyingServer(sent)))
    fleet.slots = [Slot(index=0, server=DyingServer(sent), state="serving")]
    for _ in range(MAX_RESTARTS):  # each time: the engine dies, its replacement comes up, the job admits it
        assert fleet.generate([[1]], SPEC, [5]) is None
        assert fleet.wait_for_replacement() == fleet.slots[:1]
        fleet.slots[0].state = "serving"
    assert fleet.generate([[1]], SPEC, [5]) is None  # the call goes on after each admission: no fresh restarts
    with pytest.raises(EngineError, match="none could be brought back"):
        fleet.wait_for_replacement()
    assert len(sent) == MAX_RESTARTS + 1


class HungServer(AnsweringServer):
    """Answers ``/health`` but never took part in the sync (its receive call timed out)."""

    def alive(self):
        return True

    def call(self, method, path, body=None, *, timeout_s):
        return {}


def test_an_engine_that_misses_the_sync_deadline_is_marked_down_and_the_sync_stands():
    from megatron_rl.inference.vllm.server import EngineDown, EngineTimeout
    from megatron_rl.inference.vllm.engine import VLLMEngine

    fleet = fleet_of("serving", start_timeout_s=60)
    fleet.slots.append(Slot(index=1, server=HungServer(), state="serving"))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.fleet, engine.version, engine.config = fleet, 3, RolloutConfig(engine="vllm", sync_timeout_s=5)
    late = EngineTimeout("POST /collective_rpc: no answer within 5 s: timed out")
    assert engine._failures({0: [{}], 1: late}) is None  # the sync stands for engine 0
    assert fleet.slots[1].state == "dead" and "rollout.sync_timeout_s" in fleet.slots[1].error
    assert fleet.slots[0].state == "serving"
    # an engine that answers but failed the sync (not a timeout) still ends the run, with its log
    fleet.slots[1].state = "serving"
    assert "failed during a weight sync" in engine._failures({1: EngineDown("POST /collective_rpc: HTTP 500: bad")})
