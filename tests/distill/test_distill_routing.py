"""Several teachers, each scoring the rows its ``when`` selects by the prompt row's data column (fast, one
process, plain torch + the single_turn environment; ~2 s).

- the config's rules (several teachers each need ``when``; scalar values) and ``check_routing``'s start-up errors;
- ``GeneratorOutput['teacher_ids']``: validated (one per trajectory step-wise), kept by merging, a ``[B]`` tensor;
- the Trainer with two bigram teachers (tests/test_trainer.py): each row's term is ``-coef * weight * (logp_student
  - logp_its_teacher)`` (a reference computed per row from its own teacher's whole-batch forward, then masked),
  each teacher's forward runs on its rows only, rows of no teacher get no term and are counted;
- the single_turn environment routes by a prompt-file column, and runs without ``reward.function`` (every reward 0).
A planted bug (rows scored by the other teacher) fails ``test_each_row_gets_its_own_teachers_term``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.distillation.config import DistillationConfig
from megatron_rl.distillation.routing import NO_TEACHER, check_routing, router, teacher_of
from megatron_rl.distillation.signal import UNSCORED_ROWS, Distillation
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output
from megatron_rl.trainer import Trainer
from tests.test_trainer import Bigram, BigramPolicy, make_config, play

TWO = [{"name": "m", "hf_path": "/unused", "weight": 0.5, "when": {"domain": "math"}},
       {"name": "c", "hf_path": "/unused", "weight": 2.0, "when": {"domain": "code"}}]
COEF = 0.3


@pytest.mark.parametrize("teachers, message", [
    ("[{name: a, hf_path: /x}, {name: b, hf_path: /y, when: {d: 1}}]",
     r"distillation\.teachers\[0\]\.when is unset but there are 2 teachers"),
    ("[{name: a, hf_path: /x, when: {d: [1, 2]}}]", r"distillation\.teachers\[0\]\.when=.*scalar value"),
    ("[{name: a, hf_path: /x, when: {}}]", r"distillation\.teachers\[0\]\.when=\{\} must be a non-empty mapping"),
])
def test_routing_mistakes_name_the_key(teachers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"distillation.teachers={teachers}"])


def test_rows_go_to_the_teacher_whose_when_matches_and_overlaps_are_refused_at_start_up():
    cfg = DistillationConfig(teachers=TWO)
    assert cfg.routed and router(DistillationConfig(teachers=[{"name": "t", "hf_path": "/x"}])) is None
    route = router(cfg)
    assert [route(r) for r in ({"domain": "math"}, {"domain": "code", "x": 1}, {"domain": "art"}, {})] == \
        [0, 1, NO_TEACHER, NO_TEACHER]
    check_routing(cfg, [{"domain": "math"}, {"domain": "art"}], "data.train_files")
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\]\.when: no row of data\.train_files has a "
                                          r"column 'domain' \(columns: \['topic'\]\)"):
        check_routing(cfg, [{"topic": "math"}], "data.train_files")
    overlap = DistillationConfig(teachers=[{**TWO[0]}, {**TWO[1], "when": {"level": 1}}])
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\] and \[1\] both match row 1 of data\.x"):
        check_routing(overlap, [{"domain": "math", "level": 2}, {"domain": "math", "level": 1}], "data.x")
    assert teacher_of(overlap.teachers, {"domain": "math", "level": 1}) == 0  # not seen at start-up: the first wins


def _routed_rollouts(student: BigramPolicy) -> dict:
    """Step-wise digit games (merged by the trainer), each trajectory's teacher by its prompt (group): 0, 1, -1, 0."""
    out = episodes_to_generator_output(play(student.model, num_prompts=4), step_wise=True)
    out["teacher_ids"] = [[0, 1, NO_TEACHER][uid % 3] for uid in out["uids"]]
    return out


def test_teacher_ids_are_one_per_trajectory_and_survive_merging():
    out = _routed_rollouts(BigramPolicy(Bigram(seed=0), lr=0.0))
    merged, _ = merge_stepwise_output(out)
    assert len(merged["uids"]) < len(out["uids"])  # turns were merged
    assert merged["teacher_ids"] == [[0, 1, NO_TEACHER][uid % 3] for uid in merged["uids"]]
    bad = copy.deepcopy(out)
    bad["teacher_ids"][1] = 5 if out["trajectory_ids"][1] == out["trajectory_ids"][0] else bad["teacher_ids"][1]
    with pytest.raises(ValueError, match=r"teacher_ids'\]\[1\] = 5 differs .* within trajectory"):
        validate_generator_output(bad, step_wise=True)
    with pytest.raises(ValueError, match=r"teacher_ids'\]\[0\] = 'math'"):
        validate_generator_output({**out, "teacher_ids": ["math"] * len(out["uids"])}, step_wise=True)


class CountingPolicy(BigramPolicy):
    """A bigram teacher that records the rows of each forward."""

    def __init__(self, model: Bigram) -> None:
        super().__init__(model, lr=0.0)
        self.rows: list[int] = []

    def forward(self, batch, **kwargs):
        self.rows.append(len(batch))
        return super().forward(batch, **kwargs)


def test_each_row_gets_its_own_teachers_term():
    student = BigramPolicy(Bigram(seed=0), lr=0.1)
    teachers = [CountingPolicy(Bigram(seed=1)), CountingPolicy(Bigram(seed=2))]
    cfg = make_config(merge=True)
    cfg.distillation = DistillationConfig(teachers=TWO, coef=COEF)
    distillation = Distillation(cfg.distillation, teachers)
    trainer = Trainer(cfg, student, distillation=distillation)
    out = _routed_rollouts(student)

    batch = trainer.to_training_batch(trainer.validate_and_merge(out, {}))
    ids = batch["teacher_ids"].clone()
    trainer.add_old_and_ref_logprobs(batch)
    metrics = distillation.score(batch)
    assert [t.rows for t in teachers] == [[int((ids == 0).sum())], [int((ids == 1).sum())]]  # its rows only
    assert metrics[UNSCORED_ROWS].final() == float((ids == NO_TEACHER).sum()) > 0
    # reference: every teacher on the whole batch, then each row takes its own teacher's (masked)
    whole = [t.forward(batch)["logprobs"] for t in teachers]
    for index, name in enumerate(("m", "c")):
        rows = ids == index
        assert torch.equal(batch[f"teacher_logprobs/{name}"][rows], whole[index][rows].float())
    task = copy.deepcopy(batch)
    Trainer(make_config(merge=True), student).add_advantages(task)
    distill_metrics = trainer.add_advantages(batch)
    mask, student_lp = batch["loss_mask"], batch["old_logprobs"]
    expected = task["advantages"].clone()
    for row in range(len(ids)):
        if ids[row] >= 0:
            kl = student_lp[row] - whole[int(ids[row])][row]
            expected[row] += torch.where(mask[row] > 0, -COEF * TWO[int(ids[row])]["weight"] * kl, torch.zeros(()))
    assert torch.allclose(batch["advantages"], expected, atol=1e-6, rtol=0)
    assert torch.equal(batch["advantages"][ids == NO_TEACHER], task["advantages"][ids == NO_TEACHER])
    for index, name in enumerate(("m", "c")):
        rows = (ids == index).float()[:, None] * mask
        kl = (student_lp - whole[index]) * rows
        assert distill_metrics[f"distill/{name}/tokens"].final() == float(rows.sum())
        assert distill_metrics[f"distill/{name}/reverse_kl"].final() == pytest.approx(float(kl.sum() / rows.sum()),
                                                                                     rel=1e-5)
    step = trainer.train_step(out)  # the whole step runs with routed rows
    assert step[UNSCORED_ROWS] == float((ids == NO_TEACHER).sum())


def test_routed_teachers_need_teacher_ids():
    student = BigramPolicy(Bigram(seed=0), lr=0.1)
    cfg = make_config(merge=True)
    cfg.distillation = DistillationConfig(teachers=TWO)
    trainer = Trainer(cfg, student, distillation=Distillation(cfg.distillation, [student, student]))
    out = episodes_to_generator_output(play(student.model, num_prompts=4), step_wise=True)
    with pytest.raises(ValueError, match="carry no GeneratorOutput\\['teacher_ids'\\]"):
        trainer.train_step(out)
    with pytest.raises(ValueError, match=r"holds 0\.\.3: give each row the index"):
        trainer.train_step({**out, "teacher_ids": list(out["uids"])})


def test_single_turn_routes_rows_by_a_column_and_needs_no_reward_function(tmp_path):
    from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
    from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec
    from tests.environments.conftest import load_example
    from tests.environments.test_single_turn import oracle_and_noise
    from transformers import AutoTokenizer

    load_example("make_model").save_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    domains = ["math", "code", "art"]
    rows = [{"prompt": f"{a} plus one equals", "domain": domains[a % 3]} for a in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = SingleTurnEnvironment(DataConfig(train_files=str(tmp_path / "p.jsonl"), shuffle=False),
                                RewardConfig(function=None), tokenizer, seed=0, max_prompt_tokens=16,
                                teacher_of=router(DistillationConfig(teachers=TWO)))
    assert "pure distillation" in env.describe()
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=env.stop_token_ids)
    out = env.rollout(BuiltinEngine(oracle_and_noise(tokenizer)), spec, num_prompts=6, n_samples_per_prompt=2,
                      seed=1, step_wise=False).output
    validate_generator_output(out, step_wise=False)
    assert out["teacher_ids"] == [[0, 1, NO_TEACHER][a % 3] for a in range(6) for _ in range(2)]
    assert out["rewards"] == [0.0] * 12


def test_step_api_episodes_carry_their_rows_teacher_on_every_turn(tmp_path):
    """A step-API class's data rows route like prompt rows: every turn (step-wise row) of an episode, and the
    placeholder row of an episode that failed in ``reset``, has its data row's teacher; merging keeps it. The
    registry builds the environment with the router and checks the columns at start-up; the job config accepts
    ``when`` for a step-API class (the agent shares the code path: ``failures.py: assemble_episodes``)."""
    from megatron_rl.environments.registry import make_environment
    from megatron_rl.job.config import load_job_config
    from tests.environments.test_step_api import GAME, answer, make, rollout
    from tests.support.chat_helpers import ScriptedEngine
    from tests.support.job_run import example_module

    domains = ["math", "code", "art", "math"]
    rows = [{"digits": [d, (d + 3) % 10], "domain": domains[d]} for d in range(4)]
    rows[3]["fail_reset"] = True  # a 'math' episode with no turn: its placeholder row keeps the teacher
    source = GAME.replace("fail_reset=False):", "fail_reset=False, **_):")  # Game(**row) gets 'domain' too
    env, tok = make(tmp_path, rows=rows, source=source, teacher_of=router(DistillationConfig(teachers=TWO)))
    out = rollout(env, ScriptedEngine(tok, answer), num_prompts=4).output
    checked = validate_generator_output(out, step_wise=True)  # one teacher per trajectory
    expected = {uid: [0, 1, NO_TEACHER, 0][uid] for uid in range(4)}  # uid = the row (no shuffle, first epoch)
    assert checked["teacher_ids"] == [expected[u] for u in out["uids"]]
    assert sorted(set(out["uids"])) == [0, 1, 2, 3] and out["uids"].count(3) == 1  # 3: the placeholder
    merged, _ = merge_stepwise_output(checked)
    assert merged["teacher_ids"] == [expected[u] for u in merged["uids"]]

    example_module("examples/arithmetic/make_model.py").make_model(tmp_path / "model", seed=5)  # raw text
    routed = "distillation.teachers=[{name: m, hf_path: /x, when: {domain: math}}, " \
             "{name: c, hf_path: /y, when: {domain: code}}]"
    overrides = [f"job.environment={tmp_path / 'game.py'}:Game", f"data.train_files={tmp_path / 'train.jsonl'}",
                 f"model.hf_path={tmp_path / 'model'}", "eval.interval=0", routed]
    config = load_job_config(None, overrides)  # a step-API class has data columns: 'when' is accepted
    with pytest.raises(ConfigError, match=r"distillation\.teachers\[0\]\.when: no row of data\.train_files has a "
                                          r"column 'topic'"):
        make_environment(load_job_config(None, [*overrides[:-1], routed.replace("domain: math", "topic: math")]))
    assert make_environment(config).teacher_of({"domain": "code"}) == 1
