"""bench_small_end: its pure helpers (medians over the steps after warm-up, the table and its ratios, the reward).
The runs themselves (the main job, TRL) take minutes: BENCHMARKS.md "The small end" has their table."""

import bench_small_end as bench


def test_summary_and_table():
    steps = [{"timing/step_s": s, "timing/rollout_s": s / 2, "timing/update_s": 0.1,
              "timing/old_logprobs_s": 0.0, "timing/old_logprobs_skipped": 1.0} for s in (9.0, 9.0, 1.0, 2.0, 3.0)]
    builtin = bench.summarize("builtin", {"wall_s": 30.0, "steps": steps, "startup_s": 12.0}, first=3)
    assert builtin["step"] == 2.0 and builtin["rollout"] == 1.0 and builtin["skipped"] == 1.0
    trl = bench.summarize("trl", {"wall_s": 10.0, "step_s": [5.0, 0.5, 0.5, 1.0]}, first=3)
    assert trl["step"] == 0.75
    text = bench.table([builtin, trl, {"system": "vllm", "error": "not installed"}], first=3, steps=5)
    assert "| builtin | 2.000 | 2.67x | 1.000 | 0.000 (skipped) | 0.100 | - | 12.0 | 30 |" in text
    assert "| vllm | not installed |" in text


def test_reward():
    namespace = {}
    exec(bench.REWARD_SOURCE, namespace)
    assert namespace["reward"](prompt="what is one plus one ?", response="two", answer="two") == 1.0
    assert namespace["reward"](prompt="p", response="it is two", answer="two") == 0.1
    assert namespace["reward"](prompt="p", response="", answer="two") == 0.0


def test_ratio_ranges_are_taken_within_each_round():
    rows = [{"system": "builtin", "step": 0.2, "startup": 9.0, "round": 1},
            {"system": "trl", "step": 0.1, "startup": 0.3, "round": 1},
            {"system": "builtin", "step": 0.3, "startup": 8.0, "round": 2},
            {"system": "trl", "step": 0.3, "startup": 0.4, "round": 2}]
    text = bench.ratio_ranges(rows)
    assert "| builtin | 2.00x, 1.00x | 1.00-2.00x | 8.0-9.0 |" in text  # not 0.25 / 0.2 pooled over rounds
    assert "| trl | 1.00x, 1.00x | 1.00-1.00x | 0.3-0.4 |" in text
