"""``distillation.kind: full_kl``: the full-vocabulary KL as a loss term, exact against plain torch and the same at
one process, TP2, PP2 and DP2 (gloo, CPU, fp32).

The student is a 2-layer, hidden-64, vocabulary-128 Llama checkpoint (the default ``ModelConfig`` shapes, saved
by ``transformers``); the teacher the 4-layer, hidden-96, vocabulary-129 one of ``conftest.py`` (TP2 pads it to
130, the student stays at 128: the shards differ, so the teacher's logits are re-cut to the student's). The rows
are ``test_distill_multirank``'s (left-padded, packed THD inside), rewards 0 (pure distillation: GRPO's task
advantage is 0, so the loss is the KL term alone). Checked, each against ``transformers``' forward of every
sequence alone (``log_softmax`` over the student's 128 ids for both models, ``sum p_s (log p_s - log p_t)``):
- the step's loss is ``coef`` times the token mean of the KL, ``distill/t/full_kl`` that mean, and the grad norm
  is transformers' gradient norm of the same loss (the norm of every parameter's gradient, which fused QKV /
  gate-up layouts do not change), each to rel 1e-5: fp32, the same sums in other orders; measured at one process
  rel 2e-7 - 2.3e-6 (abs < 1e-7): the KL of two near-uniform random models is ~0.03, a difference of sums of
  terms ~log(128) = 4.9, so fp32 rounding of those terms shows ~10x larger relative to the KL;
- the same loss, grad norm and metrics at TP2 (the KL's reductions over the TP group, the re-cut teacher shards),
  PP2 (the teacher's logits from its own pipeline pass, kept on the last stage) and DP2 (rows split);
- two teachers routed by ``when`` (``teacher_ids``), weights 1 and 0.5, one row of no teacher: each row's KL is
  its own teacher's times its weight, the unscored row adds nothing but counts in the token mean (every layout);
- ``vocab_parallel_kl``'s value and gradient (w.r.t. the student's logits) against autograd of the plain formula,
  at one process and over a TP2 group (the planted bugs below, each checked to fail; see docs/DISTILLATION.md).
Cost: ~1 s for the fast test; the slow ones ~60-90 s on 2 cores (one rank, three layouts of two, one TP2 spawn).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.model.logprobs import vocab_parallel_kl
from tests.distill.test_distill_multirank import COEF, LAYOUTS, ROUTE, _config, _rollouts
from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture

STUDENT_VOCAB = 128
WEIGHT_B = 0.5
TOL = 1e-5


def make_student(path) -> str:
    """A Llama of the default ``ModelConfig`` shapes (2 layers, hidden 64, vocabulary 128), norms perturbed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=STUDENT_VOCAB,
                                  max_position_embeddings=512, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------------------ the ranks

def _full_kl_config(dirs: dict, tp: int, pp: int, routed: bool):
    from megatron_rl.distillation.config import DistillationConfig

    cfg = _config(dirs["a"], tp, pp)
    teachers = [{"name": "t", "hf_path": dirs["a"]}]
    if routed:
        teachers = [{"name": "a", "hf_path": dirs["a"], "when": {"d": 0}},
                    {"name": "b", "hf_path": dirs["b"], "weight": WEIGHT_B, "when": {"d": 1}}]
    return dataclasses.replace(cfg, distillation=DistillationConfig(teachers=teachers, coef=COEF, kind="full_kl"))


def _step(dirs: dict, groups, tp: int, pp: int, routed: bool) -> dict[str, float]:
    """One pure-distillation ``Trainer.train_step`` of a freshly loaded student."""
    from megatron_rl.distillation.teachers import build_distillation
    from megatron_rl.hf.weights import policy_from_hf
    from megatron_rl.trainer import Trainer

    cfg = _full_kl_config(dirs, tp, pp, routed)
    policy = policy_from_hf(cfg, groups, hf_dir=dirs["student"], pad_token_id=0)
    distillation = build_distillation(cfg, groups, pad_token_id=0)
    rollouts = {**_rollouts(), "teacher_ids": ROUTE} if routed else _rollouts()
    return Trainer(policy.config, policy, distillation=distillation).train_step(rollouts)


def _run(dirs: dict, tp: int, pp: int) -> dict:
    from megatron_rl.config import ParallelConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed

    groups = initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                    1234)
    return {"one": _step(dirs, groups, tp, pp, False), "routed": _step(dirs, groups, tp, pp, True)}


def _reference_rank(rank, world_size, dirs):
    return _run(dirs, 1, 1)


def _layout_rank(rank, world_size, dirs, tp, pp):
    return _run(dirs, tp, pp)


# ------------------------------------------------------------------------------------------------ plain torch

def _hf_logits(path: str) -> list[torch.Tensor]:
    """Each row's next-token logits at its response positions ``[r_i, V]`` (one sequence at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for prompt, response in zip(_rollouts()["prompt_token_ids"], _rollouts()["response_ids"]):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, :-1]
        rows.append(logits[-len(response):])
    return rows


def full_kl_of(x: torch.Tensor, y: torch.Tensor, vocab: int) -> torch.Tensor:
    """Plain ``KL(softmax(x) || softmax(y))`` over the last dim's first ``vocab`` columns."""
    log_p, log_q = torch.log_softmax(x[..., :vocab], dim=-1), torch.log_softmax(y[..., :vocab], dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def full_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``KL(p_s || p_t)`` per row of ``[n, V]`` logits over the student's ids."""
    return full_kl_of(student, teacher, STUDENT_VOCAB)


def _reference_loss(dirs: dict, routed: bool, *, kl=full_kl, shift: int = 0) -> tuple[float, float, dict]:
    """transformers' loss (``coef`` x the token mean of each row's weighted KL), its gradient norm over the
    student's parameters, and each teacher's token-mean KL over its rows. ``shift``: the teacher's logits one
    token off (a planted bug)."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(dirs["student"], dtype=torch.float32)
    teachers = {name: _hf_logits(dirs[name]) for name in ("a", "b")}
    rows, terms, per_teacher = _rollouts(), [], {"a": [], "b": []}
    for i, (prompt, response) in enumerate(zip(rows["prompt_token_ids"], rows["response_ids"])):
        name, weight = ("a", 1.0) if not routed or ROUTE[i] == 0 else ("b", WEIGHT_B)
        logits = student(input_ids=torch.tensor([prompt + response])).logits[0, :-1][-len(response):]
        teacher = teachers[name][i].detach().roll(shift, dims=0)
        if routed and ROUTE[i] == -1:
            continue  # no teacher: nothing added (its tokens still count in the token mean below)
        row_kl = kl(logits, teacher)
        per_teacher[name].append(row_kl.detach())
        terms.append(weight * row_kl)
    loss = COEF * torch.cat(terms).sum() / sum(len(r) for r in rows["response_ids"])
    loss.backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in student.parameters()))
    return float(loss.detach()), float(norm), {k: float(torch.cat(v).mean()) for k, v in per_teacher.items() if v}


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def tensors(teacher_dir, tmp_path_factory):  # what each layout gets: the checkpoints
    from tests.distill.conftest import make_teacher

    root = tmp_path_factory.mktemp("full_kl")
    return {"student": make_student(root / "student"), "a": str(teacher_dir),
            "b": str(make_teacher(root / "second", seed=8))}


@pytest.fixture(scope="module")
def reference(tensors):
    return run_ranks(1, _reference_rank, tensors, timeout=300)[0]


layout_results = layout_fixture(lambda name, dirs, ref: run_ranks(2, _layout_rank, dirs, *LAYOUTS[name], timeout=300))


@pytest.fixture(scope="module")
def plain(tensors):
    return {"one": _reference_loss(tensors, False), "routed": _reference_loss(tensors, True)}


def _assert_matches(metrics: dict, expected: tuple[float, float, dict], teachers: tuple[str, ...]) -> None:
    loss, norm, kls = expected
    assert metrics["policy/loss"] == pytest.approx(loss, rel=TOL, abs=1e-7)
    assert metrics["optim/grad_norm"] == pytest.approx(norm, rel=TOL)
    for name in teachers:
        assert metrics[f"distill/{name}/full_kl"] == pytest.approx(kls["a" if name == "t" else name], rel=TOL)


# ------------------------------------------------------------------------------------------------ tests

@pytest.mark.slow
def test_the_loss_and_its_gradient_are_plain_torchs(reference, plain):
    metrics = reference["one"]
    _assert_matches(metrics, plain["one"], ("t",))
    assert metrics["policy/pg_loss"] == 0.0  # rewards 0: the KL is the whole loss
    assert metrics["distill/t/tokens"] == sum(len(r) for r in _rollouts()["response_ids"])
    assert metrics["distill/t/full_kl"] > 1e-3 and metrics["optim/grad_norm"] > 0


@pytest.mark.slow
def test_the_reference_fails_on_planted_bugs(tensors, plain):
    """The checks above would see a swapped direction or the teacher one token off."""
    loss, norm, _ = plain["one"]
    swapped = _reference_loss(tensors, False, kl=lambda s, t: full_kl(t.detach(), s))  # KL(p_t || p_s)
    shifted = _reference_loss(tensors, False, shift=1)
    for wrong in (swapped, shifted):
        assert abs(wrong[0] - loss) > 100 * TOL * loss or abs(wrong[1] - norm) > 100 * TOL * norm


@pytest.mark.slow
def test_two_teachers_each_distil_their_rows(reference, plain):
    metrics = reference["routed"]
    _assert_matches(metrics, plain["routed"], ("a", "b"))
    assert metrics["distill/unscored_rows"] == ROUTE.count(-1)
    assert metrics["distill/a/tokens"] + metrics["distill/b/tokens"] < metrics["batch/loss_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_step_is_the_same_in_every_layout(layout, layout_results, plain):
    for rank_out in layout_results(layout):
        _assert_matches(rank_out["one"], plain["one"], ("t",))
        _assert_matches(rank_out["routed"], plain["routed"], ("a", "b"))


def _plain_kl_and_grad(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, vocab: int):
    x = x.detach().clone().requires_grad_()
    kl = full_kl_of(x, y, vocab)
    (kl * weights).sum().backward()
    return kl.detach(), x.grad


def _logits(vocab_padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(1, 7, vocab_padded, generator=gen)
    return x, x + torch.randn(1, 7, vocab_padded, generator=gen), torch.rand(1, 7, generator=gen)


def test_the_kl_function_is_plain_torchs():
    """One process: value and gradient w.r.t. the student's logits, padding columns left out (< 1e-5, fp32)."""
    x, y, weights = _logits(12)
    ours = x.clone().requires_grad_()
    kl = vocab_parallel_kl(ours, y, None, valid_vocab_size=10)
    (kl * weights).sum().backward()
    expected, grad = _plain_kl_and_grad(x, y, weights, 10)
    assert (kl - expected).abs().max() < TOL and (ours.grad - grad).abs().max() < TOL
    assert not ours.grad[..., 10:].any()
    assert (full_kl_of(y, x, 10) - expected).abs().max() > 100 * TOL  # the direction matters here


def _tp_kl_rank(rank, world_size):
    from megatron_rl.config import ParallelConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed

    groups = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), 1)
    x, y, weights = _logits(12)
    cols = slice(6 * rank, 6 * rank + 6)
    ours = x[..., cols].clone().requires_grad_()
    kl = vocab_parallel_kl(ours, y[..., cols], groups.tp_group, valid_vocab_size=11)
    (kl * weights).sum().backward()
    return {"kl": kl.detach(), "grad": ours.grad}


@pytest.mark.slow
def test_the_kl_function_over_a_tp_group_is_plain_torchs():
    """TP2: each rank holds half the columns (the last one padding); the KL is the full row's on both ranks and
    each rank's gradient is its columns' of the plain one."""
    x, y, weights = _logits(12)
    expected, grad = _plain_kl_and_grad(x, y, weights, 11)
    for rank, out in enumerate(run_ranks(2, _tp_kl_rank, timeout=120)):
        assert (out["kl"] - expected).abs().max() < TOL
        assert (out["grad"] - grad[..., 6 * rank:6 * rank + 6]).abs().max() < TOL


def test_a_batch_without_teacher_ids_is_refused_on_every_rank_before_any_forward():
    from types import SimpleNamespace

    from megatron_rl.distillation.config import DistillationConfig
    from megatron_rl.distillation.full_kl import FullKLTerm

    config = DistillationConfig(teachers=[{"name": "t", "hf_path": "/x"}], kind="full_kl")
    term = FullKLTerm(config, [None], torch.zeros(2, dtype=torch.int64), torch.ones(2, 3))
    call = SimpleNamespace(microbatches=[SimpleNamespace(tensors={"loss_mask": torch.ones(2, 3)})])
    with pytest.raises(ValueError, match=r"distillation\.kind=full_kl needs the batch's 'teacher_ids'"):
        term.prepare(call, SimpleNamespace(pp_size=1))
