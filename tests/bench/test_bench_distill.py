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
