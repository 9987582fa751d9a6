"""The run's summary tells the truth (issue 38): where the wall time went, a run too short to compare windows says
so, and "no learning signal" only when the signal is missing for most steps or the reward never moves, with the
likely cause read from the rewards. Synthetic metrics rows, as metrics.jsonl holds them."""

from __future__ import annotations

from megatron_rl.job.reporting import WallTimes, launch_time, summary_paragraph

TIMES = WallTimes(startup_s=88.0, loop_s=22.0, total_s=117.0)


def row(step: int, mean: float, low: float, high: float, zero_advantage: float) -> dict[str, float]:
    return {"step": step, "reward/mean": mean, "reward/min": low, "reward/max": high,
            "rollout/zero_advantage_groups": zero_advantage}


def test_a_run_that_learns_gets_no_warning_even_when_solved_prompts_give_no_signal():
    """The CPU demo's shape: no signal while nothing is solved (all zero), then learning, then many groups whose
    responses are all right: 58 of 200 steps without a signal is normal, not a warning."""
    rows = [row(s, 0.0, 0.0, 0.0, 1.0) for s in range(1, 21)]  # 20 steps: every response 0
    rows += [row(s, 0.03 + 0.004 * s, 0.0, 1.0, 0.3) for s in range(21, 163)]
    rows += [row(s, 1.0, 1.0, 1.0, 1.0) if s % 2 else row(s, 0.7, 0.0, 1.0, 0.6) for s in range(163, 201)]
    text = summary_paragraph(rows, baseline=0.032, times=TIMES)
    assert "After 200 train steps (117 s of wall time: 88 s of start-up" in text and "22 s of training loop" in text
    assert "the policy learned: mean reward 0.000 over the first 5 steps -> 0.820 over the last 5 steps" in text
    assert "learning signal" not in text and "likely cause" not in text


def test_a_run_that_does_not_learn_says_why_all_zero():
    rows = [row(s, 0.0, 0.0, 0.0, 1.0) for s in range(1, 40)] + [row(40, 0.02, 0.0, 1.0, 0.9)]
    text = summary_paragraph(rows, baseline=None, times=TIMES)
    assert "the policy did not clearly learn" in text
    assert "No learning signal in 39 of 40 steps" in text
    assert "likely cause: every response got reward 0 (all zero): the task is out of reach" in text
    assert "samples.jsonl" in text


def test_a_solved_task_is_named_all_one():
    text = summary_paragraph([row(s, 1.0, 1.0, 1.0, 1.0) for s in range(1, 13)], baseline=None, times=TIMES)
    assert "No learning signal in 12 of 12 steps" in text and "(all one): the prompts are solved" in text


def test_rewards_fixed_by_the_prompt_and_a_reward_that_never_moves():
    by_prompt = [row(s, 0.5, 0.0, 1.0, 1.0) for s in range(1, 13)]  # each group uniform, groups differ
    text = summary_paragraph(by_prompt, baseline=None, times=TIMES)
    assert "No learning signal in 12 of 12 steps" in text and "each prompt's responses got the same reward" in text
    still = [row(s, 0.25, 0.0, 1.0, 0.2) for s in range(1, 13)]  # a signal, but nothing changes
    text = summary_paragraph(still, baseline=None, times=TIMES)
    assert "The mean reward never moved (0.250 at each of 12 steps); likely cause: the updates are too small" in text


def test_a_run_too_short_to_compare_windows_says_so():
    rows = [row(1, 0.1, 0.0, 1.0, 0.0), row(2, 0.2, 0.0, 1.0, 0.0), row(3, 0.4, 0.0, 1.0, 0.0)]
    text = summary_paragraph(rows, baseline=None, times=TIMES)
    assert "the run is too short to judge learning (3 steps with a reward" in text
    assert "mean reward 0.100 at step 1 -> 0.400 at step 3" in text and "first 5 steps" not in text


def test_the_launch_time_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_LAUNCH_TIME", "1700000000,25")  # bash's $EPOCHREALTIME in a comma locale
    assert launch_time() == 1700000000.25
    times = WallTimes.since(launched=100.0, loop_started=160.0, now=190.0)
    assert (times.startup_s, times.loop_s, times.total_s) == (60.0, 30.0, 90.0)
    monkeypatch.delenv("MEGATRON_RL_LAUNCH_TIME")
    assert 0 < launch_time() <= __import__("time").time()  # this process's start


def test_the_start_up_splits_into_its_phases():
    from megatron_rl.job import startup

    marks = {"imports": 104.0, "distributed": 104.5, "model": 107.0, "engine": 110.0}  # not resumed: no 'resume'
    parts = startup.split(launched=100.0, process_started=101.5, marks=marks)
    assert parts == [("launch", 1.5), ("imports", 2.5), ("distributed", 0.5), ("model", 2.5), ("engine", 3.0)]
    times = WallTimes.since(launched=100.0, loop_started=110.2, now=120.0, startup_parts=parts)
    assert ("10 s of start-up (launch 1.5 s, imports 2.5 s, distributed 0.5 s, model 2.5 s, engine 3.0 s) and "
            "10 s of training loop") in times.phrase()


def test_the_first_failure_names_file_and_line_and_its_traceback_is_kept_once(tmp_path, capsys):
    from megatron_rl.environments.failures import failure
    from megatron_rl.job.reporting import FAILURE_FILE, RunReporter

    def user_code(row):
        return {"a": 1}[row]  # the line the failure names

    failures = []
    for row in ("b", "c"):
        try:
            user_code(row)
        except KeyError as err:
            failures.append(failure(len(failures), 3, err))
    reporter = RunReporter(tmp_path, total_steps=2, tensorboard=False, progress_bar=False)
    reporter.note_failures(failures, "reward.function")
    reporter.note_failures(failures[1:], "reward.function")
    reporter.close()
    out = capsys.readouterr().out.strip().splitlines()
    line = user_code.__code__.co_firstlineno + 1
    assert len(out) == 1 and f"reward.function failed on row 3: KeyError: 'b' (at {__file__}:{line})" in out[0]
    assert f"its traceback is in {tmp_path / FAILURE_FILE}" in out[0]
    kept = (tmp_path / FAILURE_FILE).read_text()
    assert "Traceback (most recent call last)" in kept and "KeyError: 'b'" in kept and "'c'" not in kept


def test_a_multi_turn_sample_shows_every_turn_in_samples_jsonl_the_summary_and_tensorboard(tmp_path):
    from megatron_rl.environments.base import Sample
    from megatron_rl.job.reporting import RunReporter, format_sample, read_metrics

    turns = [{"prompt": "<|im_start|>user 3 + 4?<|im_end|>", "response": '<tool_call>{"name": "add"}</tool_call>',
              "tool_calls": [{"name": "add", "arguments": '{"a": 3, "b": 4}'}]},
             {"prompt": "<|im_start|>tool 7<|im_end|>", "response": "7<|im_end|>", "tool_calls": []}]
    reporter = RunReporter(tmp_path, total_steps=1, tensorboard=True, progress_bar=False)
    reporter.log_samples(1, "train", [Sample(turns[0]["prompt"], "7<|im_end|>", 1.0, row=2, turns=turns, end="done")])
    reporter.close()
    record = read_metrics(tmp_path / "samples.jsonl")[0]
    assert record["turns"] == turns and record["end"] == "done" and record["reward"] == 1.0
    text = format_sample(record)
    assert text.splitlines()[0] == "[step 1 train, row 2] reward 1.000, 2 turn(s), ended: done"
    assert "turn 2 prompt: <|im_start|>tool 7<|im_end|>" in text and 'turn 1 tool calls: add({"a": 3, "b": 4})' in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    shown = events.Tensors("samples/train/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "&lt;|im_start|&gt;tool 7" in shown  # the markers escaped, so markdown shows them
