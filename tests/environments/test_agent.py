"""OpenAI-client agents (``job.agent=<file.py>:<function>``) without an engine: the hermes parser, the endpoint's
token check and its ChatCompletion answers (read by the real ``openai`` client), and an episode's calls recorded
as step-wise rows trained token-exact (a scripted fleet stands in for vLLM: the recording is under test, not the
engine; the real engine runs in tests/job/test_agent_job.py); failed episodes left out as every environment's
(``environments/failures.py``); mistakes in the function found at start-up."""

from __future__ import annotations

import json
import textwrap
import time
import threading
from pathlib import Path

import pytest
from tests.support.chat_helpers import KEEP_HISTORY, STRIP_REASONING, chat_tokenizer

from megatron_rl.config import ConfigError
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.environments.agent.endpoint import AgentEndpoint, Session
from megatron_rl.environments.agent.environment import AgentEnvironment, call_seed
from megatron_rl.environments.agent.tool_parsers import parse_hermes, tool_call_parser
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.failures import AllSamplesFailed
from megatron_rl.inference.engine import Completion, SamplingSpec

openai = pytest.importorskip("openai")

SPEC = SamplingSpec(max_tokens=6, temperature=1.0, stop_token_ids=(2,))


# ----------------------------------------------------------------------------------------------- the parser
def test_hermes_parses_tool_call_blocks_and_leaves_other_text_alone():
    text = 'let me see <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "f"}'
    parsed = parse_hermes(text)
    assert parsed.content == "let me see "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1}), ("f", {})]
    assert parse_hermes("<tool_call>{\"name\": \"g\", \"arguments\": \"{}\"}</tool_call>").content is None
    for plain in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_hermes(plain).content == plain and parse_hermes(plain).tool_calls == []
    with pytest.raises(ValueError, match="not one of"):
        tool_call_parser("qwen9")


# ----------------------------------------------------------------------------------------------- the endpoint
class ScriptedFleet:
    """``engine.AgentCalls`` (what ``Fleet.complete`` serves): ``reply(prompt text)`` (words) as the sampled ids,
    made-up log-probs; records (prompt, seed, session) of every call."""

    def __init__(self, tokenizer, reply) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.calls_waiting = threading.Event()
        self.calls: list[tuple[list[int], int, str]] = []
        self.sampled: list[list[int]] = []
        self.ended: list[str] = []
        self._lock = threading.Lock()

    def complete(self, prompt, spec, *, seed, session):
        ids = self.tokenizer(self.reply(self.tokenizer.decode(prompt)), add_special_tokens=False)["input_ids"]
        ids = ids[:spec.max_tokens]
        with self._lock:
            self.calls.append((list(prompt), seed, session))
            self.sampled.append(list(ids))
        return Completion(ids, [-0.25 - 0.01 * i for i in range(len(ids))],
                          "stop" if ids and ids[-1] in spec.stop_token_ids else "length")

    def end_session(self, session):
        self.ended.append(session)

    def serving(self):
        return [0]


class FakeEngine:
    """The part of ``RolloutEngine`` an agent uses: its ``agent_calls`` on rank 0."""

    def __init__(self, fleet) -> None:
        self.fleet = self.agent_calls = fleet


def next_digit(prompt: str) -> str:
    """The digit after the last digit of the prompt, then the eos."""
    digit = [w for w in prompt.split() if w.isdigit()][-1]
    return f"{(int(digit) + 1) % 10} <|im_end|>"


@pytest.fixture()
def tokenizer(tmp_path):
    return chat_tokenizer(tmp_path / "tok", KEEP_HISTORY)


def session_for(tokenizer, fleet, max_prompt_tokens=200) -> Session:
    return Session("s", tokenizer, fleet.complete, SPEC, seed_of_call=lambda k: 100 + k,
                   max_prompt_tokens=max_prompt_tokens, parse=parse_hermes, tokenizer_lock=threading.Lock())


def test_the_endpoint_answers_only_its_episode_tokens_with_chat_completions_the_client_reads(tokenizer):
    import urllib.error
    import urllib.request

    fleet = ScriptedFleet(tokenizer, next_digit)
    endpoint = AgentEndpoint()
    try:
        url = endpoint.open(session_for(tokenizer, fleet))
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["megatron_rl"]
        reply = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "3 ?"}],
                                               max_tokens=50, temperature=0.1)
        assert reply.choices[0].message.content == "4" and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == 2 and reply.model == "anything"
        assert reply.model_extra["prompt_token_ids"] == fleet.calls[0][0]
        assert fleet.calls[0][1] == 100  # seed_of_call(0)

        with pytest.raises(openai.BadRequestError, match="stream"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}], stream=True)
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}  # a text checkpoint
        with pytest.raises(openai.BadRequestError, match="'image_url' content part, but images need a vision-lan"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": [picture]}])
        root = url.rsplit("/", 2)[0]
        for wrong in (root + "/not-the-token/v1", root + "/v1"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=wrong, api_key="unused", max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "1"}])
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(root + "/x/v1/models")
        endpoint.close_session(url)  # the episode ended: its URL is dead
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert len(fleet.calls) == 1
    finally:
        endpoint.close()


def test_tool_calls_are_answered_as_openai_tool_calls(tokenizer):
    def reply(_prompt):  # one hermes block; the word-level tokenizer keeps the tags as unknown words
        return "3 <|im_end|>"

    fleet = ScriptedFleet(tokenizer, reply)
    session = session_for(tokenizer, fleet)
    session.tokenizer = _TextTokenizer(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    answer = session.chat({"messages": [{"role": "user", "content": "1 ?"}], "tools": [{"type": "function"}]})
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    from megatron_rl.environments.conversation import readable_turns

    parse = lambda ids: [{"name": c.name, "arguments": c.arguments}  # noqa: E731 - as AgentEnvironment._tool_calls
                         for c in parse_hermes(session.tokenizer.decode(ids)).tool_calls]
    assert readable_turns(session.turns, session.tokenizer, tool_calls=parse)[0]["tool_calls"] == [
        {"name": "add", "arguments": '{"a": 2}'}]  # the sample shows the call the agent got
    assert message["tool_calls"][0]["type"] == "function"
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    from openai.types.chat import ChatCompletion

    assert ChatCompletion.model_validate(answer).choices[0].message.tool_calls[0].function.name == "add"


class _TextTokenizer:
    """The chat tokenizer, but decoding any reply as ``text`` (a word-level vocabulary cannot spell JSON)."""

    def __init__(self, inner, text: str) -> None:
        self.inner, self.text = inner, text

    def decode(self, ids, **kwargs):
        return self.text

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- the environment
AGENT = '''
import openai

def agent(base_url, digits, fail=False, calls=2):
    """Ask for the next digit ``calls`` times in one conversation; reward: the share of right answers."""
    if fail:
        raise KeyError("this row breaks")
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "+"}, {"role": "user", "content": f"{digits[0]} ?"}]
    right = 0
    for k in range(calls):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content
        right += text.split()[-1:] == [str((digits[k] + 1) % 10)]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"{digits[k + 1]} ?"}]
    return {"reward": right / calls, "calls": calls}
'''


def make_env(tmp_path: Path, rows: list[dict], template: str = KEEP_HISTORY, source: str = AGENT,
             function: str = "agent", **kwargs) -> tuple[AgentEnvironment, object]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "agent.py").write_text(source)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = chat_tokenizer(tmp_path / "tok", template)
    data = DataConfig(train_files=str(tmp_path / "train.jsonl"), val_files=str(tmp_path / "train.jsonl"), shuffle=False)
    env = AgentEnvironment(f"{tmp_path / 'agent.py'}:{function}", data, tokenizer, seed=0,
                           max_concurrency=kwargs.pop("max_concurrency", 4),
                           max_prompt_tokens=kwargs.pop("max_prompt_tokens", 200), tool_call_parser_name="hermes",
                           **kwargs)
    return env, tokenizer


def test_an_episodes_calls_become_step_wise_rows_of_the_sampled_ids(tmp_path):
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2, 3], "fail": False, "calls": 2},
                                         {"digits": [5, 6, 7], "fail": True, "calls": 2},
                                         {"digits": [7, 8, 9], "fail": False, "calls": 1}])
    fleet = ScriptedFleet(tokenizer, next_digit)
    rollouts = env.rollout(FakeEngine(fleet), SPEC, num_prompts=3, n_samples_per_prompt=2, seed=11, step_wise=True)
    out = rollouts.output
    validate_generator_output(out, step_wise=True)
    # the failing row's two episodes are left out and counted (the group keeps one zero-loss placeholder row, so
    # the batch holds every prompt); rows 0 (2 calls) and 2 (1 call) give 2 x 3 rows
    assert rollouts.metrics["rollout/failed_samples"] == 2 and rollouts.metrics["rollout/dropped_groups"] == 1
    placeholder = out["uids"].index(1)
    assert out["loss_masks"][placeholder] == [0] * len(out["response_ids"][placeholder])
    assert rollouts.failures[0].row == 1 and "agent(base_url, **row) raised KeyError" in rollouts.failures[0].error
    for name in out:
        if isinstance(out[name], list) and len(out[name]) == 7:
            del out[name][placeholder]
    assert len(out["response_ids"]) == 6
    assert sorted(map(tuple, out["response_ids"])) == sorted(map(tuple, fleet.sampled))  # trained == sampled
    assert out["uids"] == [0, 0, 0, 0, 2, 2] and out["rewards"] == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert out["is_last_step"] == [False, True, False, True, True, True]
    assert all(mask == [1] * len(ids) for mask, ids in zip(out["loss_masks"], out["response_ids"]))
    # the second call's prompt extends the first call's prompt + its sampled ids: one merged sequence
    assert out["prompt_token_ids"][1][:len(out["prompt_token_ids"][0]) + 2] == (
        out["prompt_token_ids"][0] + out["response_ids"][0])
    assert merge_stepwise_output(out)[1]["num_seq_after_merge"] == 2 + 2  # one per episode
    assert rollouts.metrics["episode/calls_mean"] == 1.5 and rollouts.metrics["episode/new_steps_mean"] == 0
    # seeds: a function of (rollout seed, row, sample, call); each episode's calls pinned to its session
    assert {(seed, session) for _, seed, session in fleet.calls} == {
        (call_seed(11, row, sample, call), f"agent-11-{row}-{sample}")
        for row, calls in ((0, 2), (2, 1)) for sample in range(2) for call in range(calls)}
    assert len(fleet.ended) == 6 and env.state_dict() == {"consumed": 3}

    evaluation = env.evaluate(FakeEngine(fleet), SPEC, seed=5, num_prompts=None, pass_threshold=1.0)
    assert evaluation.metrics == {"eval/reward_mean": 1.0, "eval/pass_rate": 1.0, "eval/failed_samples": 1.0}
    assert [s.row for s in evaluation.samples] == [0, 1, 2] and evaluation.failures[0].row == 1
    assert [len(s.turns) for s in evaluation.samples] == [2, 0, 1]

    # a sample is the whole episode: every call's new prompt (the agent's next message), reply, tool calls
    sample, failed, single = rollouts.samples
    assert [t["prompt"].split("<|im_start|> user ")[-1] for t in sample.turns] == [
        "1 ? <|im_end|> <|im_start|> assistant", "2 ? <|im_end|> <|im_start|> assistant"]
    # the template's markers (the word-level test vocabulary has no "system": <unk>)
    assert sample.turns[0]["prompt"].startswith("<|im_start|> <unk> + <|im_end|>")
    assert [t["response"] for t in sample.turns] == ["2 <|im_end|>", "3 <|im_end|>"]  # special tokens kept
    assert [t["tool_calls"] for t in sample.turns] == [[], []] and (sample.end, sample.reward) == ("done", 1.0)
    assert (failed.end, failed.reward, failed.turns) == ("failed", None, []) and len(single.turns) == 1


def test_a_template_that_rewrites_history_starts_a_new_step(tmp_path):
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2, 3]}], template=STRIP_REASONING)
    fleet = ScriptedFleet(tokenizer, lambda prompt: "<think> 9 </think> " + next_digit(prompt))
    out = env.rollout(FakeEngine(fleet), SPEC, num_prompts=1, n_samples_per_prompt=1, seed=0, step_wise=True).output
    assert out["response_ids"] == fleet.sampled and len(out["response_ids"]) == 2
    first, second = out["prompt_token_ids"]
    assert second[:len(first) + len(out["response_ids"][0])] != first + out["response_ids"][0]
    assert merge_stepwise_output(out)[1]["num_seq_after_merge"] == 2


def test_every_episode_failing_stops_and_mistakes_are_found_at_start_up(tmp_path):
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2], "fail": True}])
    with pytest.raises(AllSamplesFailed, match=r"agent\(base_url, \*\*row\) raised KeyError: 'this row breaks'"):
        env.rollout(FakeEngine(ScriptedFleet(tokenizer, next_digit)), SPEC, num_prompts=1, n_samples_per_prompt=2,
                    seed=0, step_wise=True)
    with pytest.raises(ConfigError, match="cannot take row 0 of data.train_files, whose columns are"):
        make_env(tmp_path / "b", [{"digits": [1], "colour": "red"}])
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        make_env(tmp_path / "c", [{"digits": [1]}], function="nope")
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        make_env(tmp_path / "d", [{"digits": [1]}], template=None)


def test_a_call_past_the_prompt_limit_is_refused_and_the_episode_keeps_its_calls(tmp_path):
    source = AGENT + textwrap.dedent('''
        def long_agent(base_url, digits):
            try:
                return agent(base_url, digits, calls=3)
            except openai.BadRequestError as err:
                assert err.code == "context_length_exceeded", err
                return 0.5
        ''')
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2, 3, 4]}], source=source, function="long_agent",
                              max_prompt_tokens=20)
    fleet = ScriptedFleet(tokenizer, next_digit)
    rollouts = env.rollout(FakeEngine(fleet), SPEC, num_prompts=1, n_samples_per_prompt=1, seed=0, step_wise=True)
    assert rollouts.output["rewards"][-1] == 0.5 and 1 <= len(rollouts.output["response_ids"]) < 3
    assert rollouts.metrics["episode/ended_context"] == 1


def test_an_agent_implies_the_vllm_fleet_and_step_wise_training_and_refuses_the_builtin_engine(tmp_path):
    from megatron_rl.job.config import load_job_config

    base = [f"model.hf_path={tmp_path}", "data.train_files=rows.jsonl", "job.agent=agent.py:agent"]
    config = load_job_config(None, base)  # the generic command of docs/JOB.md: nothing else to set
    assert config.rollout.engine == "vllm" and config.rl.stepwise.step_wise_trajectories
    assert config.rl.stepwise.merge_stepwise_output
    with pytest.raises(ConfigError, match="rollout.engine='builtin'; remove it"):
        load_job_config(None, [*base, "rollout.engine=builtin"])
    with pytest.raises(ConfigError, match=r"rollout.tool_call_parser='qwen9' is not one of \['hermes', 'none'\]"):
        load_job_config(None, [*base, "rollout.tool_call_parser=qwen9"])
    with pytest.raises(ConfigError, match="an agent is its own environment"):
        load_job_config(None, [*base, "job.environment=single_turn"])


def test_an_episode_past_its_time_limit_is_a_failed_sample_and_the_step_goes_on(tmp_path, capsys, monkeypatch):
    """A hung agent (a tool waiting on a dead service) with job.episode_timeout_s=2: the step returns soon after,
    the hung episodes count as failed samples with one line each naming the row and the limit, the others train;
    while waiting, a line names the slow episodes (every SLOW_REPORT_S, lowered here)."""
    from megatron_rl.environments import episodes

    monkeypatch.setattr(episodes, "SLOW_REPORT_S", 0.5)
    source = AGENT + textwrap.dedent('''
        import time

        def hanging_agent(base_url, digits, hang=False):
            if hang:
                time.sleep(3600)
            return agent(base_url, digits, calls=1)
        ''')
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2], "hang": False}, {"digits": [3, 4], "hang": True}],
                              source=source, function="hanging_agent", episode_timeout_s=2.0)
    started = time.monotonic()
    rollouts = env.rollout(FakeEngine(ScriptedFleet(tokenizer, next_digit)), SPEC, num_prompts=2,
                           n_samples_per_prompt=2, seed=0, step_wise=True)
    assert time.monotonic() - started < 10  # the limit, plus the 0.5 s polling
    assert rollouts.metrics["rollout/failed_samples"] == 2 and rollouts.metrics["rollout/dropped_groups"] == 1
    assert [f.row for f in rollouts.failures] == [1, 1]
    assert "ran past job.episode_timeout_s=2 s" in rollouts.failures[0].error
    printed = capsys.readouterr().out
    assert printed.count("ran past job.episode_timeout_s=2 s: counted as a failed sample") == 2
    assert "episode of row 1 (sample 0)" in printed and "episode of row 1 (sample 1)" in printed
    assert "the step waits on 2 job.agent episode(s) running for over 0.5 s: row 1 (sample" in printed
    assert rollouts.output["rewards"][:2] == [1.0, 1.0]  # row 0's episodes trained


class LostEngineFleet(ScriptedFleet):
    """The only engine is down when the episodes start: each call waits (as ``Fleet.complete`` does) until the
    job has admitted the replacement (``FakeEngine.admit_replacements``)."""

    def __init__(self, tokenizer, reply) -> None:
        super().__init__(tokenizer, reply)
        self.back = threading.Event()

    def serving(self):
        return [0] if self.back.is_set() else []

    def complete(self, prompt, spec, *, seed, session):
        while not self.back.is_set():
            self.calls_waiting.set()
            time.sleep(0.05)
        return super().complete(prompt, spec, seed=seed, session=session)


class AdmittingEngine(FakeEngine):
    def __init__(self, fleet) -> None:
        super().__init__(fleet)
        self.admissions = 0

    def admit_replacements(self):
        self.admissions += 1
        self.fleet.calls_waiting.clear()
        self.fleet.back.set()


def test_agent_calls_wait_for_the_replacement_engine(tmp_path):
    env, tokenizer = make_env(tmp_path, [{"digits": [1, 2, 3]}])
    engine = AdmittingEngine(LostEngineFleet(tokenizer, next_digit))
    rollouts = env.rollout(engine, SPEC, num_prompts=1, n_samples_per_prompt=2, seed=0, step_wise=True)
    assert engine.admissions == 1 and rollouts.metrics["rollout/failed_samples"] == 0
    assert rollouts.output["rewards"][-1] == 1.0


def test_an_agent_asking_for_its_own_temperature_is_told_once_that_the_jobs_is_used(monkeypatch, capsys):
    from megatron_rl.environments.agent import endpoint

    monkeypatch.setattr(endpoint, "_sampling_noted", __import__("threading").Event())
    spec = SamplingSpec(max_tokens=8, temperature=1.0, top_p=1.0)
    assert endpoint.note_sampling_request({"temperature": 1, "top_p": 1.0}, spec) is None  # the job's own values
    line = endpoint.note_sampling_request({"temperature": 0.2, "top_p": 1.0}, spec)
    assert line is not None and "asked for temperature=0.2; every call is sampled with the job's temperature=1" in line
    assert endpoint.note_sampling_request({"temperature": 0.3}, spec) is None  # once per process
    assert capsys.readouterr().err.count("asked for") == 1
