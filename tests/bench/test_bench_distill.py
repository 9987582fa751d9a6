"""bench_distill: its pure helpers (the eval rows of metrics.jsonl, the first step at the teacher's reward, the
table). The runs themselves (the main job, 50 steps each) take minutes: BENCHMARKS.md section 15 has their table."""

import bench_distill as bench


def _rows(rewards: dict[int, float]) -> list[dict]:
    """metrics.jsonl rows of steps 1..5; the steps in ``rewards`` evaluated (pass rate = reward / 2)."""
    return [{"step": s, "reward/mean": 0.1, **({"eval/reward_mean": rewards[s], "eval/pass_rate": rewards[s] / 2}
                                               if s in rewards else {})} for s in range(1, 6)]


def test_evals_and_first_step_at_the_teacher():
    found = bench.evals(_rows({2: 0.5, 3: 0.85, 4: 0.7, 5: 0.9}))
    assert sorted(found) == [2, 3, 4, 5] and found[3] == {"pass": 0.425, "reward": 0.85}
    assert bench.first_reaching(found, 0.85) == 3  # reached (not exceeded) counts; the first, not the best
    assert bench.first_reaching(found, 0.95) is None


def test_table():
    teacher = {"pass": 0.75, "reward": 0.85}
    runs = [{"arm": "rl", "seed": 1, "wall_s": 61.4, "evals": bench.evals(_rows({2: 0.5, 5: 0.9}))},
            {"arm": "distill", "seed": 1, "wall_s": 70.0, "evals": bench.evals(_rows({2: 0.3, 5: 0.5}))},
            {"arm": "pure", "seed": 1, "wall_s": 50.0, "evals": {5: {"pass": 0.4, "reward": 0.45}}},
            {"arm": "pure", "seed": 2, "error": "run pure_s2 failed (exit 2; pure_s2.log)"}]
    text = bench.table(teacher, runs, report=[2, 5], steps=5)
    assert "| teacher (RL, 300 steps) | 1 | - | 0.75 / 0.850 at step 300 | - | - |" in text
    assert "| rl | 1 | 0.25 / 0.500 | 0.45 / 0.900 | 5 | 61 |" in text
    assert "| distill | 1 | 0.15 / 0.300 | 0.25 / 0.500 | not within 5 | 70 |" in text
    assert "| pure | 1 | - | 0.40 / 0.450 | - (evaluated at the end only) | 50 |" in text
    assert "| pure | 2 | failed: run pure_s2 failed" in text


def test_the_two_teacher_demo_helpers(tmp_path):
    """The demo's data (the example's rows with ``op``), each arm's teachers, each half's pass rate from the
    evaluation's answers in samples.jsonl, and its table."""
    import json
    from pathlib import Path

    data = bench.demo_data(tmp_path)
    train = [json.loads(line) for line in data["train"].read_text().splitlines()]
    assert len(train) == 20 and all(r["op"] == bench.op_of(r["prompt"]) for r in train)
    assert [r["op"] for r in train] == ["one"] * 10 + ["two"] * 10  # the example's order, unchanged
    assert all(json.loads(line)["op"] == "two" for line in data["train_two"].read_text().splitlines())
    halves = {"one": Path("/A"), "two": Path("/B")}
    assert bench.teacher_overrides("routed", Path("/T"), halves) == [
        "distillation.teachers=[{name: one, hf_path: /A, when: {op: one}}, {name: two, hf_path: /B, when: {op: two}}]"]
    assert bench.teacher_overrides("teacher_two", Path("/T"), halves) == [
        "distillation.teachers=[{name: two, hf_path: /B}]"]
    assert bench.teacher_overrides("rl", Path("/T"), halves) == []
    answers = [("3 plus one equals", 1.0), ("4 plus one equals", 0.5), ("3 plus two equals", 0.0),
               ("5 plus two equals", None)]  # pass = reward >= 1 (0.5: right digit, then more)
    records = [{"step": 5, "split": "eval", "prompt": p, "reward": r} for p, r in answers]
    records.append({"step": 5, "split": "train", "prompt": "1 plus two equals", "reward": 1.0})  # not an evaluation
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench.half_pass_rates(tmp_path) == {5: {"one": 0.5, "two": 0.0}}
    teachers = {"one": {"evals": {150: {"pass": 0.45, "reward": 0.5}}, "halves": {150: {"one": 0.9, "two": 0.0}}}}
    runs = [{"arm": "routed", "seed": 2, "wall_s": 80.2, "evals": bench.evals(_rows({2: 0.5, 5: 0.9})),
             "halves": {5: {"one": 0.5, "two": 0.0}}}]
    text = bench.halves_table(teachers, 150, runs, report=[2, 5], steps=5)
    assert "| teacher one (RL on 'plus one' only, 150 steps) | 1 | - | 0.45 at step 150 | 0.90 | 0.00 | - |" in text
    assert "| routed | 2 | 0.25 | 0.45 | 0.50 | 0.00 | 80 |" in text
