"""A teacher of its own size in the trainer's ranks: exact against transformers, and one distillation step the same
at one process, TP2, PP2 and DP2 (gloo, CPU, fp32).

The student is a random ``ModelConfig()`` (2 layers, hidden 64, vocabulary 128); the teacher a 4-layer, hidden-96
Llama checkpoint (``conftest.py``), built by ``distillation.teachers.build_distillation`` like the main job builds
it. Each run scores a left-padded batch of rollouts (rows of different lengths, packed THD inside) and takes one
``Trainer.train_step`` of pure distillation (rewards all 0: GRPO's task advantage is 0). Checked:
- the teacher's per-token log-probs equal ``transformers``' forward of each sequence alone (< 1e-5), every layout;
- the step's loss, grad norm and ``distill/t/*`` metrics equal the one-process run's (rel 1e-5);
- the wiring: ``distill/t/reverse_kl`` is the mean of (the student's log-probs - transformers' teacher's) over
  the sampled tokens; the old log-probs are the update's, so the ratio is 1 and the token-mean loss is exactly
  ``coef * distill/t/reverse_kl``;
- an off-by-one between the teacher's tokens and the student's (a shifted column) is far outside the tolerance;
- two teachers routed by ``when`` (``teacher_ids`` per row, as the single_turn environment writes them): each scores
  only its rows (2 and 3 of 6: odd under DP2), and each row's log-probs are its own teacher's per transformers,
  every layout; the row of no teacher stays 0 (a row scored by the other teacher fails it).
Cost: ~40-70 s on 2 cores (four spawns: one rank, then three layouts of two).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture

pytestmark = pytest.mark.slow  # spawns ranks

PROMPTS = [[5, 9, 3], [7, 4, 4, 11, 6, 20, 8], [3, 3]]
RESPONSES = [[12, 40, 7, 9], [100, 3], [55, 6, 17, 90, 31, 4], [8], [127, 64, 5], [9, 9, 9, 2, 77]]
COEF = 0.7
TOL = 1e-5
ROUTE = [0, 1, -1, 1, 0, 1]
"""Each row's teacher in the routed run (``GeneratorOutput['teacher_ids']``; -1: none)."""


def _rollouts() -> dict:
    """Six rows, two samples per prompt, rewards 0 (pure distillation); no rollout log-probs (the trainer runs the
    student's old-log-prob forward)."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    return {"prompt_token_ids": prompts, "response_ids": RESPONSES, "rewards": [0.0] * len(prompts),
            "loss_masks": [[1] * len(r) for r in RESPONSES], "uids": [i // 2 for i in range(len(prompts))]}


def _config(teacher_dir: str, tp: int = 1, pp: int = 1):
    from megatron_rl.config import (AlgorithmConfig, BatchConfig, MegatronRLConfig, ModelConfig, OptimizerConfig,
                                    ParallelConfig)
    from megatron_rl.distillation.config import DistillationConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        model=ModelConfig(attention_backend="local"),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=100.0),
        algorithm=AlgorithmConfig(advantage_estimator="grpo", loss_reduction="token_mean"),
        batch=BatchConfig(train_batch_size=3, policy_mini_batch_size=3, micro_batch_size=2),
        distillation=DistillationConfig(teachers=[{"name": "t", "hf_path": teacher_dir}], coef=COEF),
        seed=1234,
    )


def _routed(cfg, teacher_dirs: tuple[str, str], groups) -> dict:
    """Two teachers ``a`` (rows with d=0) and ``b`` (d=1) score the rollouts routed by ``ROUTE``."""
    import dataclasses

    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distillation.config import DistillationConfig
    from megatron_rl.distillation.signal import TEACHER_LOGPROBS, UNSCORED_ROWS
    from megatron_rl.distillation.teachers import build_distillation

    teachers = [{"name": name, "hf_path": path, "when": {"d": d}}
                for d, (name, path) in enumerate(zip("ab", teacher_dirs))]
    routed = build_distillation(dataclasses.replace(cfg, distillation=DistillationConfig(teachers=teachers)), groups,
                                pad_token_id=0)
    batch = TrainingBatch.from_generator_output({**_rollouts(), "teacher_ids": ROUTE}, pad_token_id=0)
    metrics = routed.score(batch)
    return {**{name: batch[TEACHER_LOGPROBS.format(name=name)] for name in "ab"},
            "unscored": metrics[UNSCORED_ROWS].final()}


def _run(teacher_dirs: tuple[str, str], tp: int, pp: int, full_sd: dict | None) -> dict:
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distillation.signal import TEACHER_LOGPROBS
    from megatron_rl.distillation.teachers import build_distillation
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    teacher_dir = teacher_dirs[0]
    cfg = _config(teacher_dir, tp, pp)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups, pad_token_id=0)
    if full_sd is not None:
        policy.load_full_state_dict(full_sd)
    out = {"full_sd": {k: v.clone() for k, v in policy.full_state_dict().items()}} if full_sd is None else {}
    distillation = build_distillation(cfg, groups, pad_token_id=0)
    batch = TrainingBatch.from_generator_output(_rollouts(), pad_token_id=0)
    distillation.score(batch)  # the trainer's path
    out["teacher"] = batch[TEACHER_LOGPROBS.format(name="t")]
    out["student"] = policy.forward(batch)["logprobs"]  # before the step: the old log-probs
    out["response_mask"] = batch["response_mask"]
    out["metrics"] = Trainer(cfg, policy, distillation=distillation).train_step(_rollouts())
    out["routed"] = _routed(cfg, teacher_dirs, groups)
    return out


def _reference_rank(rank, world_size, teacher_dir):
    return _run(teacher_dir, 1, 1, None)


def _layout_rank(rank, world_size, teacher_dir, tp, pp, full_sd):
    return _run(teacher_dir, tp, pp, full_sd)


def _hf_logprobs(teacher_dir) -> list[torch.Tensor]:
    """transformers' log-probs of each row's response tokens, one sequence at a time (no padding, no packing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    rollouts, rows = _rollouts(), []
    for prompt, response in zip(rollouts["prompt_token_ids"], rollouts["response_ids"]):
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)[0, :-1]
        rows.append(logp.gather(-1, tokens[0, 1:, None]).squeeze(-1)[-len(response):])
    return rows


@pytest.fixture(scope="module")
def tensors(teacher_dir, tmp_path_factory):  # what layout_fixture hands each layout: the teachers' checkpoints
    from tests.distill.conftest import make_teacher

    return str(teacher_dir), str(make_teacher(tmp_path_factory.mktemp("distill") / "second", seed=8))


@pytest.fixture(scope="module")
def reference(tensors):
    return run_ranks(1, _reference_rank, tensors, timeout=300)[0]


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
layout_results = layout_fixture(lambda name, teacher_dir, ref: run_ranks(2, _layout_rank, teacher_dir, *LAYOUTS[name],
                                                                          ref["full_sd"], timeout=300))


@pytest.fixture(scope="module")
def hf_rows(tensors):
    return _hf_logprobs(tensors[0])


@pytest.fixture(scope="module")
def hf_second(tensors):
    return _hf_logprobs(tensors[1])


def _responses(teacher: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [row[m.bool()] for row, m in zip(teacher, mask)]


def _assert_exact(out: dict, hf_rows: list[torch.Tensor]) -> None:
    for i, (ours, theirs) in enumerate(zip(_responses(out["teacher"], out["response_mask"]), hf_rows)):
        assert ours.shape == theirs.shape, i
        assert (ours - theirs).abs().max() < TOL, (i, (ours - theirs).abs().max())


def test_the_teachers_logprobs_are_transformers_per_sequence(reference, hf_rows):
    _assert_exact(reference, hf_rows)


def test_an_off_by_one_between_teacher_and_student_tokens_is_caught(reference, hf_rows):
    """The teacher scoring token t+1 instead of t: each row's log-probs shifted by one token."""
    shifted = reference["teacher"].roll(-1, dims=1)
    with pytest.raises(AssertionError):
        _assert_exact(dict(reference, teacher=shifted), hf_rows)


def test_pure_distillation_loss_is_coef_times_the_reverse_kl(reference, hf_rows):
    metrics = reference["metrics"]
    student = _responses(reference["student"], reference["response_mask"])
    expected = torch.cat([s - t for s, t in zip(student, hf_rows)]).mean()  # against transformers' teacher
    assert metrics["distill/t/reverse_kl"] == pytest.approx(float(expected), rel=1e-4)
    assert metrics["distill/t/tokens"] == sum(len(r) for r in RESPONSES)
    assert abs(metrics["distill/t/reverse_kl"]) > 1e-3  # two random models: near-uniform, but not equal
    assert metrics["policy/pg_loss"] == pytest.approx(COEF * metrics["distill/t/reverse_kl"], rel=1e-5)
    assert metrics["distill/t/time_s"] > 0 and metrics["optim/grad_norm"] > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_step_is_the_same_in_every_layout(layout, layout_results, reference, hf_rows):
    for rank_out in layout_results(layout):
        _assert_exact(rank_out, hf_rows)
        for name in ("policy/pg_loss", "optim/grad_norm", "distill/t/reverse_kl", "distill/t/tokens",
                     "advantages/mean"):
            assert rank_out["metrics"][name] == pytest.approx(reference["metrics"][name], rel=1e-5, abs=1e-7), name


def _assert_routed(routed: dict, hf_by_teacher: dict[str, list[torch.Tensor]], mask: torch.Tensor) -> None:
    """Each row's log-probs are its own teacher's (transformers), the other teacher's column of it is 0."""
    for name, index in (("a", 0), ("b", 1)):
        for i, (ours, m) in enumerate(zip(routed[name], mask)):
            if ROUTE[i] == index:
                theirs = hf_by_teacher[name][i]
                assert (ours[m.bool()] - theirs).abs().max() < TOL, (name, i)
            else:
                assert not ours.any(), (name, i)  # not scored: no forward on it
    assert routed["unscored"] == ROUTE.count(-1)


def test_two_teachers_each_score_their_rows(reference, hf_rows, hf_second):
    hf = {"a": hf_rows, "b": hf_second}
    _assert_routed(reference["routed"], hf, reference["response_mask"])
    assert max((h - s).abs().max() for h, s in zip(hf_rows, hf_second)) > 100 * TOL  # the teachers differ
    wrong = dict(reference["routed"], a=reference["routed"]["b"], b=reference["routed"]["a"])  # the planted bug
    with pytest.raises(AssertionError):
        _assert_routed(wrong, hf, reference["response_mask"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_teachers_each_score_their_rows_in_every_layout(layout, layout_results, reference, hf_rows, hf_second):
    for rank_out in layout_results(layout):
        _assert_routed(rank_out["routed"], {"a": hf_rows, "b": hf_second}, rank_out["response_mask"])
