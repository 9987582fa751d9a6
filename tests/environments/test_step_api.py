"""The step-API environment (``job.environment=<file.py>:<Class>``): episodes of a user's class through an engine,
as step-wise rows trained token-exact; the turn cap and the context limit; failed episodes left out and
counted; mistakes in the class found at start-up as one line naming the class and the call; the data position
as state."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
from tests.support.chat_helpers import KEEP_HISTORY, STRIP_REASONING, ScriptedEngine, chat_tokenizer

from megatron_rl.config import ConfigError
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.environments.failures import AllSamplesFailed
from megatron_rl.environments.single_turn.config import DataConfig
from megatron_rl.environments.step_api.environment import StepApiEnvironment
from megatron_rl.inference.engine import SamplingSpec

GAME = '''
class Game:
    """Answer each digit d with d + 1; 1/len(digits) per right answer."""

    def __init__(self, digits, fail_at=-1, fail_reset=False):
        self.digits, self.turn, self.fail_at, self.fail_reset = digits, 0, fail_at, fail_reset

    def reset(self):
        if self.fail_reset:
            raise RuntimeError("this row cannot start")
        return f"{self.digits[0]} ?"

    def step(self, response):
        if self.turn == self.fail_at:
            raise RuntimeError("this row breaks")
        right = response.split()[-1:] == [str((self.digits[self.turn] + 1) % 10)]
        reward = float(right) / len(self.digits)
        self.turn += 1
        if self.turn == len(self.digits):
            return {"observation": None, "reward": reward, "done": True}
        return f"{'+' if right else '-'} {self.digits[self.turn]} ?", reward, False
'''


def answer(prompt: str, think: bool = False) -> str:
    """The right reply to the last question of ``prompt`` (``think``: with a reasoning block first)."""
    words = prompt.split()
    digit = int(words[len(words) - 1 - words[::-1].index("?") - 1])
    return ("<think> 1 </think> " if think else "") + f"{(digit + 1) % 10} <|im_end|>"


def write(tmp_path: Path, rows: list[dict], source: str = GAME, name: str = "train.jsonl") -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "game.py").write_text(source)
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "game.py", tmp_path / name


def make(tmp_path, template=KEEP_HISTORY, rows=None, source=GAME, spec="Game", max_turns=8, max_prompt=200,
         val=None, **kwargs):
    rows = rows or [{"digits": [d, (d + 3) % 10, (d + 5) % 10]} for d in range(4)]
    game, train = write(tmp_path, rows, source)
    data = DataConfig(train_files=str(train), shuffle=False)
    if val is not None:
        data = DataConfig(train_files=str(train), val_files=str(write(tmp_path, val, source, "val.jsonl")[1]),
                          shuffle=False)
    tok = chat_tokenizer(tmp_path / "tok", template)
    return StepApiEnvironment(f"{game}:{spec}", data, tok, seed=3, max_turns=max_turns,
                              max_prompt_tokens=max_prompt, **kwargs), tok


SPEC = SamplingSpec(max_tokens=8, stop_token_ids=(2,))


def rollout(env, engine, num_prompts=2, n=2):
    return env.rollout(engine, SPEC, num_prompts=num_prompts, n_samples_per_prompt=n, seed=1, step_wise=True)


def test_episodes_become_step_wise_rows_merged_per_episode(tmp_path):
    env, tok = make(tmp_path)
    engine = ScriptedEngine(tok, answer)
    out = rollout(env, engine)
    rows = validate_generator_output(out.output, step_wise=True)
    assert len(rows["response_ids"]) == 2 * 2 * 3  # rows x samples x turns
    assert rows["uids"] == [0] * 6 + [1] * 6 and rows["trajectory_ids"][:4] == [(0, 0)] * 3 + [(0, 1)]
    assert rows["rewards"][2] == pytest.approx(1.0) and rows["rewards"][:2] == [0.0, 0.0]  # summed on the last
    sampled = [tok(answer(tok.decode(p)), add_special_tokens=False)["input_ids"] for call in engine.calls for p in call]
    assert sorted(rows["response_ids"]) == sorted(sampled)  # trained ids == sampled ids
    merged, counts = merge_stepwise_output(rows)
    assert counts["num_seq_after_merge"] == 4  # history kept: one sequence per episode
    assert out.metrics["episode/turns_mean"] == 3 and out.metrics["episode/ended_done"] == 4
    assert out.metrics["episode/turn_2/reward_mean"] == pytest.approx(1 / 3)
    assert out.metrics["episode/new_steps_mean"] == 0 and out.metrics["rollout/failed_samples"] == 0
    assert [len(call) for call in engine.calls] == [4, 4, 4]  # one engine call per turn, all episodes


def test_episodes_whose_turns_span_a_weight_sync_are_counted(tmp_path):
    """Partial rollouts: the engine labels each token with its weight version; an episode whose turns come from
    more than one version counts in ``episode/mixed_versions`` (none without labels)."""
    env, tok = make(tmp_path)
    out = rollout(env, ScriptedEngine(tok, answer, version_of_call=lambda call: 3 + (call >= 2)))
    assert out.metrics["episode/mixed_versions"] == 1.0  # turns 1-2 on version 3, turn 3 on version 4
    env, tok = make(tmp_path / "same")
    out = rollout(env, ScriptedEngine(tok, answer, version_of_call=lambda call: 3))
    assert out.metrics["episode/mixed_versions"] == 0.0
    env, tok = make(tmp_path / "unlabelled")
    assert "episode/mixed_versions" not in rollout(env, ScriptedEngine(tok, answer)).metrics


def test_reasoning_stripping_template_gives_separate_steps(tmp_path):
    env, tok = make(tmp_path, template=STRIP_REASONING)
    out = rollout(env, ScriptedEngine(tok, lambda p: answer(p, think=True)))
    merged, counts = merge_stepwise_output(out.output)
    assert counts["num_seq_after_merge"] == counts["num_seq_before_merge"] == 12
    assert out.metrics["episode/new_steps_mean"] == 2


def test_turn_cap_and_context_limit_end_episodes_with_a_counted_reason(tmp_path):
    env, tok = make(tmp_path, max_turns=2)
    out = rollout(env, ScriptedEngine(tok, answer))
    assert out.metrics["episode/ended_max_turns"] == 4 and out.metrics["episode/turns_mean"] == 2
    env, tok = make(tmp_path / "short", max_prompt=14)  # the first prompt has 7 tokens, the second 17
    out = rollout(env, ScriptedEngine(tok, answer))
    assert out.metrics["episode/ended_context"] == 4 and out.metrics["episode/turns_mean"] == 1
    assert all(len(p) <= 14 for p in out.output["prompt_token_ids"])


def test_failed_episodes_leave_their_group_and_a_lonely_group_stays_masked(tmp_path):
    """The helper every environment uses (environments/failures.py, tested there on hand-made rows): a failed
    episode leaves its group; a group left with fewer than two stays as one masked placeholder, so the step
    keeps its prompts. An episode that failed in reset() has a placeholder row of its own."""
    rows = [{"digits": [1, 2]}, {"digits": [1, 2], "fail_at": 1}, {"digits": [3, 4], "fail_reset": True}]
    env, tok = make(tmp_path, rows=rows)
    out = rollout(env, ScriptedEngine(tok, answer), num_prompts=3)
    validate_generator_output(out.output, step_wise=True)
    assert out.metrics["rollout/failed_samples"] == 4 and out.metrics["rollout/dropped_groups"] == 2
    assert out.metrics["episode/ended_done"] == 2 and out.metrics["episode/turns_mean"] == 2
    uids, masks = out.output["uids"], out.output["loss_masks"]
    assert uids == [0] * 4 + [1] * 2 + [2]  # two episodes of 2 turns; a 2-turn placeholder; a reset placeholder
    assert all(any(m) for m in masks[:4]) and not any(any(m) for m in masks[4:])
    assert out.output["rewards"][4:] == [0.0] * 3 and out.output["prompt_token_ids"][6] == [env.pad_token_id]
    first = out.failures[0]
    assert (first.row, first.error) == (1, "Game.step(response) raised RuntimeError: this row breaks")
    raise_line = GAME.splitlines().index('            raise RuntimeError("this row breaks")') + 1
    assert first.where == f"{tmp_path / 'game.py'}:{raise_line}"  # the user's line, not the wrapper's
    assert first.line("the environment").endswith(f"(at {first.where})") and "this row breaks" in first.traceback
    assert out.failures[2].line("the environment").startswith("the environment failed on row 2: Game.reset() raised "
                                                              "RuntimeError: this row cannot start (at ")


def test_a_step_where_every_episode_failed_raises_all_samples_failed(tmp_path):
    env, tok = make(tmp_path, rows=[{"digits": [1, 2], "fail_at": 1}, {"digits": [1, 2], "fail_at": 0}])
    with pytest.raises(AllSamplesFailed, match=r"all 4 samples of the step failed: every episode of "
                       r"job.environment=.*:Game' failed; first: the environment failed on row 0: Game.step"):
        rollout(env, ScriptedEngine(tok, answer))


@pytest.mark.parametrize("source, spec, message", [
    (GAME, "Nope", "has no class 'Nope'"),
    ("Game = 3\n", "Game", "names a int, not a class"),
    ("class Game:\n    def reset(self): return 'x'\n", "Game", r"class Game has no method step\(response\)"),
    ("import no_such_module\n", "Game", "importing .* raised ModuleNotFoundError"),
    ("class Game:\n    def __init__(self, prompt): pass\n    def reset(self): return 'x'\n"
     "    def step(self, response): return None, 1.0, True\n", "Game", r"Game\(\*\*row\) raised TypeError"),
    ("class Game:\n    def __init__(self, **row): pass\n    def reset(self): return 3\n"
     "    def step(self, response): return None, 1.0, True\n", "Game", r"Game.reset\(\) returned '3' \(int\)"),
    ("class Game:\n    def __init__(self, **row): pass\n    def reset(self): return 'x'\n"
     "    def step(self, response): return 1.0\n", "Game", r"Game.step\(response\) returned '1.0' \(float\): it must"),
    ("class Game:\n    def __init__(self, **row): pass\n    def reset(self): return 'x'\n"
     "    def step(self, response): return 'y', float('nan'), False\n", "Game", "the reward must be a finite number"),
    ("class Game:\n    def __init__(self, **row): pass\n    def reset(self): return 'x'\n"
     "    def step(self, response): return None, 0.0, False\n", "Game", "observation is None but done is False"),
    ("class Game:\n    def __init__(self, **row): pass\n    def reset(self): return 'x'\n"
     "    def step(self, response): return [{'role': 'assistant', 'content': 'y'}], 0.0, False\n", "Game",
     r"roles allowed here are \['user', 'tool'\]"),
])
def test_mistakes_in_the_class_stop_at_start_up_with_one_line(tmp_path, source, spec, message):
    with pytest.raises(ConfigError, match=message) as err:
        make(tmp_path, source=source, spec=spec)
    assert "\n" not in str(err.value) and "job.environment=" in str(err.value)


def test_messages_need_a_chat_template(tmp_path):
    source = GAME.replace('return f"{self.digits[0]} ?"', 'return [{"role": "user", "content": "1 ?"}]')
    with pytest.raises(ConfigError, match="no chat template"):
        make(tmp_path, template=None, source=source)


def test_same_seed_same_rollouts_and_the_data_position_is_the_state(tmp_path):
    from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs

    def run(env, tok):
        return rollout(env, BuiltinEngine(uniform_next_token_logprobs(len(tok))), num_prompts=3).output

    straight, tok = make(tmp_path / "a")
    first, second = run(straight, tok), run(straight, tok)
    resumed, tok = make(tmp_path / "b")
    assert run(resumed, tok) == first
    resumed, tok = make(tmp_path / "c")
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())) | {"consumed": 3})
    assert run(resumed, tok) == second


def test_evaluation_plays_each_held_out_row_once(tmp_path):
    val = [{"digits": [d, d]} for d in range(5)]
    env, tok = make(tmp_path, val=val)
    metrics = env.evaluate(ScriptedEngine(tok, answer), SPEC, seed=0, num_prompts=None, pass_threshold=1.0).metrics
    assert metrics["eval/reward_mean"] == pytest.approx(1.0) and metrics["eval/pass_rate"] == 1.0
    assert "step-API environment Game" in env.describe() and "val: 5 rows" in env.describe()


def test_raw_text_without_a_chat_template(tmp_path):
    env, tok = make(tmp_path, template=None)
    out = rollout(env, ScriptedEngine(tok, answer))
    assert merge_stepwise_output(out.output)[1]["num_seq_after_merge"] == 4
    assert out.metrics["episode/turn_3/reward_mean"] == pytest.approx(1 / 3)


def test_the_example_of_docs_job_md_runs(tmp_path):
    """The step-API class printed in docs/JOB.md, as written, through the environment."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "JOB.md").read_text()
    source = text.split("## A multi-turn environment of your own")[1].split("```python\n")[1].split("```")[0]
    env, tok = make(tmp_path, rows=[{"secret": 5}, {"secret": 2}], source=source, spec="Guess", max_turns=3)
    out = rollout(env, ScriptedEngine(tok, lambda prompt: "2 <|im_end|>"))
    assert out.metrics["episode/ended_done"] == 2 and out.metrics["episode/ended_max_turns"] == 2
    assert out.output["rewards"][-1] == 1.0 and out.metrics["episode/new_steps_mean"] == 0


def test_a_sample_is_the_whole_episode_every_turn_with_its_markers(tmp_path):
    """samples.jsonl's record of an episode: each turn's new prompt text (the observation, the template's markers
    kept), the reply, the reward, why it ended; the same for evaluation and for a failed episode."""
    rows = [{"digits": [0, 3, 5]}, {"digits": [1, 2], "fail_at": 1}]
    env, tok = make(tmp_path, rows=rows, val=rows)
    out = rollout(env, ScriptedEngine(tok, answer))
    first, failed = out.samples  # one per row: the first episode of each group
    assert [t["prompt"] for t in first.turns] == [f"<|im_start|> user {q} <|im_end|> <|im_start|> assistant"
                                                  for q in ("0 ?", "+ 3 ?", "+ 5 ?")]
    assert [t["response"] for t in first.turns] == ["1 <|im_end|>", "4 <|im_end|>", "6 <|im_end|>"]
    assert (first.reward, first.end, first.row, first.prompt, first.response) == (
        1.0, "done", 0, first.turns[0]["prompt"], "6 <|im_end|>")
    assert (failed.reward, failed.end, len(failed.turns)) == (None, "failed", 2) and "this row breaks" in failed.error
    evaluation = env.evaluate(ScriptedEngine(tok, answer), SPEC, seed=0, num_prompts=None, pass_threshold=1.0)
    assert [len(s.turns) for s in evaluation.samples] == [3, 2]


def test_a_class_imports_the_module_beside_it(tmp_path, monkeypatch):
    """``from guess_rules import ...`` in the user's file works without PYTHONPATH: its folder is on the path."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # undone after the test
    (tmp_path / "sibling_rules_for_step_api.py").write_text("def next_digit(d):\n    return (d + 1) % 10\n")
    source = GAME.replace("class Game:", "from sibling_rules_for_step_api import next_digit\n\n\nclass Game:", 1)
    env, tok = make(tmp_path, source=source)
    assert str(tmp_path) == sys.path[0] and env.user.name == "Game"


def test_a_module_on_the_path_names_the_class_too(tmp_path, monkeypatch):
    from megatron_rl.environments.step_api.user_class import UserClass

    (tmp_path / "my_step_env_module.py").write_text(GAME)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert UserClass("my_step_env_module:Game").name == "Game"
    with pytest.raises(ConfigError, match="cannot import 'no_such_step_module'"):
        UserClass("no_such_step_module:Game")


def test_an_episode_past_its_time_limit_is_a_failed_sample_and_the_step_goes_on(tmp_path, capsys, monkeypatch):
    """A step() that hangs on one row (a tool waiting on a dead service), job.episode_timeout_s=1.5: the rollout
    returns soon after, its episodes are failed samples with one line each naming the row and the limit, a line
    names the slow call meanwhile (every SLOW_REPORT_S, lowered here), the other row trains."""
    from megatron_rl.environments import episodes

    monkeypatch.setattr(episodes, "SLOW_REPORT_S", 0.5)
    source = GAME.replace("    def step(self, response):\n", "    def step(self, response):\n"
                          "        if self.digits[0] == 7:\n            import time; time.sleep(3600)\n")
    env, tok = make(tmp_path, rows=[{"digits": [1, 2]}, {"digits": [7, 8]}], source=source, episode_timeout_s=1.5)
    started = time.monotonic()
    out = rollout(env, ScriptedEngine(tok, answer), num_prompts=2)
    assert time.monotonic() - started < 10  # two hung episodes, 1.5 s each (the calls of one rank run in turn)
    assert out.metrics["rollout/failed_samples"] == 2 and out.metrics["rollout/dropped_groups"] == 1
    assert [f.row for f in out.failures] == [1, 1] and "job.episode_timeout_s=1.5 s" in out.failures[0].error
    printed = capsys.readouterr().out
    assert printed.count("ran past job.episode_timeout_s=1.5 s: counted as a failed sample") == 2
    assert "episode of row 1 (sample 0)" in printed and "the step waits on row 1 (sample 0) in Game.step" in printed
    assert out.metrics["episode/ended_done"] == 2


def test_an_episode_that_failed_on_another_rank_only_fails_here_too(tmp_path, monkeypatch):
    """The ranks agree on the failed episodes (the union): one that failed on another rank only (its class raised
    there) is a counted failure on this one too, so every rank trains on the same rows."""
    from megatron_rl.distributed import rank0

    calls = []

    def other_rank_failed_episode_1(values: set) -> set:  # what rank 1 adds, at the first agreement
        calls.append(values)
        return values | ({(1, False)} if len(calls) == 1 else set())

    monkeypatch.setattr(rank0, "union_over_ranks", other_rank_failed_episode_1)
    env, tok = make(tmp_path, rows=[{"digits": [1, 2]}, {"digits": [3, 4]}])
    out = rollout(env, ScriptedEngine(tok, answer), num_prompts=2)
    assert out.metrics["rollout/failed_samples"] == 1 and out.metrics["rollout/dropped_groups"] == 1
    assert out.failures[0].row == 0 and "failed on another rank" in out.failures[0].error
    assert len(calls) >= 2 and not any(calls[1:])  # known everywhere once agreed: not gathered again
