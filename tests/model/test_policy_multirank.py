"""MegatronPolicy under TP2, PP2, DP2, TP2xPP2 (gloo) against single-process references.

One 1-rank spawn builds the reference: the full weights, per-row log-probs and gradients of the global summed
loss from a plain GPTModel with plain torch autograd (no packing, no schedule, no DDP), and the weights after
one optimizer step of a single-process MegatronPolicy. Each layout then runs in one spawn that loads those
weights and returns everything the tests compare: forward log-probs, gradients after
forward_backward + finalization for several micro-batch counts, metrics, weights after a step, and (DP2) the
deferred-finalization, scaling-factor-ablation and bad-input checks. Spawns are module-scoped and shared.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.batches import full_grads as _full_grads, left_padded_tensors, max_rel_err, micro_batch_size as _micro_batch_size, training_batch as _batch
from megatron_rl.metrics import Metric
from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture, reference_fixtures

pytestmark = pytest.mark.slow  # spawns ranks

PROMPT_LENS = [3, 9, 2, 5, 12, 4, 6]
RESPONSE_LENS = [6, 2, 11, 4, 1, 8, 5]  # uneven token counts; B=7 is odd, so DP2 adds a dummy row
MB_COUNTS = (1, 2, 4)
LR = 0.05


# ---------------------------------------------------------------------- shared helpers (run in the children)


def _config(tp: int = 1, pp: int = 1, *, optimizer: str = "sgd", distributed: bool = False,
            sequence_parallel: bool = False):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                sequence_parallel=sequence_parallel),
        model=ModelConfig(attention_backend="local"),
        optimizer=OptimizerConfig(optimizer=optimizer, lr=LR, clip_grad=1.0, use_distributed_optimizer=distributed),
        seed=1234,
    )


def _batch_tensors(seed: int = 0, vocab: int = 128) -> dict[str, torch.Tensor]:
    """Left-padded [B, S] / right-aligned [B, R] tensors (docs/DESIGN.md section 2), built by hand."""
    g = torch.Generator().manual_seed(seed)
    t = left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, vocab, g, loss_drop=0.2, advantages=True)
    t["loss_mask"][1] = 0.0  # a row with no loss token
    return t


def summed_pg_loss(logprobs, entropy, mb, loss_config):
    """The simple summed policy-gradient loss of the brief, with metrics of every reduce kind."""
    mask = mb["loss_mask"]
    loss = -(logprobs * mb["advantages"] * mask).sum()
    metrics = {
        "loss": Metric(loss.detach(), 1.0, "sum"),
        "loss_tokens": Metric(mask.sum(), 1.0, "sum"),
        "logprob_mean": Metric((logprobs.detach() * mask).sum(), mask.sum(), "mean"),
        "logprob_min": Metric(float(logprobs.detach()[mask > 0].min()) if mask.any() else math.inf, 1.0, "min"),
    }
    return loss, metrics


def _fresh_policy(cfg, groups, full_sd):
    from megatron_rl.model.policy import MegatronPolicy

    policy = MegatronPolicy(cfg, groups)
    policy.load_full_state_dict(full_sd)
    return policy


def _grad_runs(policy, batch, dp_size: int, counts: tuple[int, ...]) -> dict:
    """Gradient after forward_backward + finalize for each micro-batch count, plus the metrics."""
    out = {}
    for count in counts:
        policy.config.batch.micro_batch_size = _micro_batch_size(len(batch), dp_size, count)
        out[f"metrics_{count}"] = policy.forward_backward(batch, summed_pg_loss, None)
        policy.finalize_grads()
        out[f"grad_{count}"] = _full_grads(policy)
        policy.zero_grad()
    return out


def _token_budget_run(policy, batch) -> dict:
    """Token-budget micro-batches (packs of different lengths; under DP2 some ranks get a dummy one)."""
    policy.config.batch.micro_batch_size = None
    policy.config.batch.max_tokens_per_micro_batch = 22  # DP2: 2 packs on rank 0, 3 on rank 1 -> a dummy
    metrics = policy.forward_backward(batch, summed_pg_loss, None)
    policy.finalize_grads()
    grads = _full_grads(policy)
    policy.zero_grad()
    policy.config.batch.max_tokens_per_micro_batch = None
    policy.config.batch.micro_batch_size = 4
    return {"metrics_budget": metrics, "grad_budget": grads}


def _step(policy, batch) -> dict:
    policy.forward_backward(batch, summed_pg_loss, None)
    info = policy.optim_step()
    return {"step_info": info, "weights": policy.full_state_dict()}


# ---------------------------------------------------------------------- the reference (1 rank)


def _row_logprobs(model, tensors) -> torch.Tensor:
    """[B, R] log-probs, one plain (unpacked, causal) forward per row, placed right-aligned by hand."""
    seqs, am = tensors["sequences"], tensors["attention_mask"]
    width, resp_width = seqs.shape[1], tensors["response_mask"].shape[1]
    rows = []
    for i in range(seqs.shape[0]):
        tokens = seqs[i][am[i].bool()][None]  # [1, n]
        n = tokens.shape[1]
        logits = model(tokens, torch.arange(n)[None], None)  # [1, n, V]
        lp = torch.log_softmax(logits.float(), dim=-1)[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0]  # [n-1]
        full = torch.zeros(width, dtype=lp.dtype)
        full = torch.cat([full[: width - n], lp, full[:1]])  # column c predicts column c+1
        rows.append(full[width - resp_width - 1 : width - 1])
    return torch.stack(rows)


def _reference_rank(rank, world_size, tensors):
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.builder import build_gpt_model
    from megatron_rl.model.weights import load_full_state_dict
    from megatron_rl.model.policy import MegatronPolicy

    cfg = _config()
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    full_sd = {k: v.clone() for k, v in policy.full_state_dict().items()}
    plain = build_gpt_model(cfg.model, cfg.parallel, groups)
    load_full_state_dict(plain, full_sd, groups)
    logprobs = _row_logprobs(plain, tensors)
    loss = -(logprobs * tensors["advantages"] * tensors["loss_mask"]).sum()
    loss.backward()
    out = {
        "full_sd": full_sd,
        "logprobs": logprobs.detach(),
        "loss": float(loss),
        "grads": {k: p.grad.clone() for k, p in plain.named_parameters()},
    }
    batch = _batch(tensors)
    out.update(_step(_fresh_policy(cfg, groups, full_sd), batch))
    out["adam_weights"] = _step(_fresh_policy(_config(optimizer="adam"), groups, full_sd), batch)["weights"]
    out.update(_bad_input_checks(policy, tensors))
    out["lrs"] = _lr_schedule(groups, batch, full_sd)
    out.update(_checkpoint_roundtrip(_fresh_policy(_config(optimizer="adam"), groups, full_sd), batch))
    out.update(_frozen_reference(cfg, groups, batch, full_sd))
    return out


def _frozen_reference(cfg, groups, batch, full_sd) -> dict:
    """role='reference': same forward path, no gradients, no optimizer."""
    from megatron_rl.model.policy import MegatronPolicy

    frozen = MegatronPolicy(cfg, groups, role="reference")
    frozen.load_full_state_dict(full_sd)
    out = {"frozen_logprobs": frozen.forward(batch)["logprobs"]}
    out["frozen_trainable"] = sum(p.requires_grad for p in frozen.module.parameters())
    try:
        frozen.forward_backward(batch, summed_pg_loss, None)
        out["frozen_fb"] = "no error"
    except ValueError as err:
        out["frozen_fb"] = str(err)
    return out


def _checkpoint_roundtrip(policy, batch) -> dict:
    """save_checkpoint, one step, load_checkpoint: the saved weights and trainer state come back."""
    import tempfile

    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

    # Adam state first: a checkpoint saved before the first step does not load yet (KeyError 'step' in
    # checkpoint/optimizer_state.py, reported to its owner).
    _step(policy, batch)
    saved = policy.full_state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(policy, tmp, {"step": 3})
        _step(policy, batch)
        state = load_checkpoint(policy, tmp)
    return {"ckpt_state": state, "ckpt_saved": saved, "ckpt_restored": policy.full_state_dict()}


def _lr_schedule(groups, batch, full_sd) -> list[float]:
    """LR of optimizer steps 1..6 with 2 warmup steps and linear decay to min_lr over 4 steps."""
    cfg = _config()
    cfg.optimizer.lr_warmup_steps, cfg.optimizer.lr_decay_style, cfg.optimizer.min_lr = 2, "linear", 0.01
    from megatron_rl.model.policy import MegatronPolicy

    policy = MegatronPolicy(cfg, groups, total_optim_steps=4)  # decay horizon from the run length
    one_row = batch.slice(0, 1)
    return [_step(policy, one_row)["step_info"]["lr"] for _ in range(6)]


def _bad_input_checks(policy, tensors) -> dict:
    """Each bad input must raise ValueError naming the field, before any collective."""
    cases = {}

    def case(name, mutate):
        bad = {k: v.clone() for k, v in tensors.items()}
        mutate(bad)
        try:
            policy.forward(_batch(bad))
            cases[name] = "no error"
        except ValueError as err:
            cases[name] = str(err)

    case("token_id", lambda t: t["sequences"].__setitem__((0, -1), 128))
    case("negative_token_id", lambda t: t["sequences"].__setitem__((2, -1), -3))
    case("too_long", lambda t: t.update(_too_long(t)))
    case("loss_mask_shape", lambda t: t.update(loss_mask=t["loss_mask"][:, 1:]))
    case("attention_mask_shape", lambda t: t.update(attention_mask=t["attention_mask"][:, 1:]))
    # A micro-batch with no valid loss token: finite zero loss and zero gradient.
    zero = {k: v.clone() for k, v in tensors.items()}
    zero["loss_mask"].zero_()
    policy.config.batch.micro_batch_size = 2
    metrics = policy.forward_backward(_batch(zero), summed_pg_loss, None)
    policy.finalize_grads()
    grads = _full_grads(policy)
    policy.zero_grad()
    cases["zero_mask_loss"] = metrics["loss"].final()
    cases["zero_mask_grad_max"] = max(float(g.abs().max()) for g in grads.values())
    return {"bad_inputs": cases}


def _too_long(t):
    long = 600  # > max_position_embeddings=512
    seqs = torch.ones(t["sequences"].shape[0], long, dtype=torch.long)
    am = torch.ones_like(seqs)
    return {"sequences": seqs, "attention_mask": am}


# ---------------------------------------------------------------------- the layouts


def _layout_rank(rank, world_size, tp, pp, counts, tensors, full_sd, extras):
    from megatron_rl.distributed.bootstrap import initialize_distributed

    cfg = _config(tp, pp)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    batch = _batch(tensors)
    policy = _fresh_policy(cfg, groups, full_sd)
    out = {"dp_size": groups.dp_size}
    out["forward"] = {k: v.cpu() for k, v in policy.forward(batch, compute_entropy=True).items()}
    out.update(_grad_runs(policy, batch, groups.dp_size, counts))
    out.update(_token_budget_run(policy, batch))
    out.update(_step(_fresh_policy(cfg, groups, full_sd), batch))
    if "dp_checks" in extras:
        out.update(_dp_checks(cfg, groups, batch, tensors, full_sd))
    if "sequence_parallel" in extras:
        out.update(_variant_run(_config(tp, pp, sequence_parallel=True), groups, batch, full_sd, "sp"))
    if "fixed_shapes" in extras:
        out.update(_variant_run(cfg, groups, batch, full_sd, "fixed_shapes", variable_seq_lengths=False))
    if pp > 1:
        out["broken_loss"] = _broken_loss_check(policy, batch)
    return out


def _broken_loss_check(policy, batch) -> str:
    """A loss_fn that raises (here: a missing batch key) must raise on every pipeline stage, not only on the
    last one where the schedule runs it (the others would wait forever for its gradient)."""

    def broken_loss(logprobs, entropy, mb, ctx):
        return summed_pg_loss(logprobs, entropy, {**mb, "advantages": mb["no_such_key"]}, ctx)

    try:
        policy.forward_backward(batch, broken_loss, None)
        return "no error"
    except KeyError as err:
        policy.forward(batch)  # the stages still run collectives together afterwards
        return f"KeyError {err}"


def _variant_run(cfg, groups, batch, full_sd, name: str, variable_seq_lengths: bool = True) -> dict:
    """Forward and token-budget gradient of a variant (sequence parallel; PP packs extended to one length)."""
    policy = _fresh_policy(cfg, groups, full_sd)
    policy.module.config.variable_seq_lengths = variable_seq_lengths
    out = {f"{name}_forward": policy.forward(batch)["logprobs"].cpu()}
    out.update({f"{name}_{k}": v for k, v in _token_budget_run(policy, batch).items()})
    return out


def _dp_checks(cfg, groups, batch, tensors, full_sd) -> dict:
    from megatron_rl.model import scaling

    out = {}
    # Deferred finalization: two forward_backward calls on halves + one step == one call on the whole.
    policy = _fresh_policy(cfg, groups, full_sd)
    policy.forward_backward(batch.slice(0, 3), summed_pg_loss, None)
    policy.forward_backward(batch.slice(3, len(batch)), summed_pg_loss, None)
    out["halves_step_info"] = policy.optim_step()
    out["halves_weights"] = policy.full_state_dict()
    # Ablations: each factor of the contract dropped in turn must break gradient invariance.
    policy = _fresh_policy(cfg, groups, full_sd)
    original = scaling.megatron_loss_scale
    policy.config.batch.micro_batch_size = _micro_batch_size(len(batch), groups.dp_size, 2)
    for name, fake in {"no_dp": lambda n, d: n, "no_num_microbatches": lambda n, d: d}.items():
        scaling.megatron_loss_scale = fake
        try:
            policy.forward_backward(batch, summed_pg_loss, None)
        finally:
            scaling.megatron_loss_scale = original
        policy.finalize_grads()
        out[f"ablation_{name}"] = _full_grads(policy)
        policy.zero_grad()
    # Distributed optimizer (Adam only) across DP ranks.
    out["adam_weights"] = _step(_fresh_policy(_config(optimizer="adam", distributed=True), groups, full_sd), batch)[
        "weights"
    ]
    # Bad input on every rank: ValueError everywhere, then the ranks still agree in collectives.
    bad = {k: v.clone() for k, v in tensors.items()}
    bad["sequences"][0, -1] = 10_000
    try:
        policy.forward(_batch(bad))
        out["bad_input"] = "no error"
    except ValueError as err:
        out["bad_input"] = str(err)
    out["after_bad_input"] = policy.forward(batch)["logprobs"].cpu()
    return out


# ---------------------------------------------------------------------- fixtures


tensors, reference = reference_fixtures(_batch_tensors, _reference_rank, timeout=300)


LAYOUTS = {  # name: (world size, tp, pp, micro-batch counts, extra checks)
    "tp2": (2, 2, 1, MB_COUNTS, ("sequence_parallel",)),
    "pp2": (2, 1, 2, MB_COUNTS, ("fixed_shapes",)),
    "dp2": (2, 1, 1, MB_COUNTS, ("dp_checks",)),
    "tp2xpp2": (4, 2, 2, (2,), ()),  # 4 ranks on 2 cores are slow: one count (plus the token budget)
}


def _run_layout(name, tensors, reference):
    world, tp, pp, counts, extras = LAYOUTS[name]
    return run_ranks(world, _layout_rank, tp, pp, counts, tensors, reference["full_sd"], extras, timeout=600)


layout_results = layout_fixture(_run_layout)


# ---------------------------------------------------------------------- tests




def test_reference_policy_matches_plain_autograd(reference):
    """Sanity of the reference itself: grads are non-trivial and cover every parameter."""
    assert reference["loss"] != 0.0
    assert set(reference["grads"]) <= set(reference["full_sd"])
    assert all(torch.isfinite(g).all() for g in reference["grads"].values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_logprobs_layout_parity(layout, layout_results, reference, tensors):
    for rank_out in layout_results(layout):
        got = rank_out["forward"]["logprobs"]
        diff = (got - reference["logprobs"]).abs().max()
        assert diff < 1e-5, f"{layout}: max |logprob diff| {diff:.2e}"
        assert got.shape == reference["logprobs"].shape
        assert torch.isfinite(rank_out["forward"]["entropy"]).all()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradient_invariance(layout, layout_results, reference):
    """Gradient after finalize == single-process gradient of the global summed loss, for 1, 2, 4 micro-batches."""
    for rank_out in layout_results(layout):
        for key in [f"grad_{c}" for c in LAYOUTS[layout][3]] + ["grad_budget"]:
            err = max_rel_err(rank_out[key], reference["grads"])
            assert err < 1e-5, f"{layout} {key}: relative error {err:.2e}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_metrics_identical_on_every_rank(layout, layout_results, reference, tensors):
    results = layout_results(layout)
    for key in [f"metrics_{c}" for c in LAYOUTS[layout][3]] + ["metrics_budget"]:
        first = {k: m.final() for k, m in results[0][key].items()}
        for rank_out in results[1:]:
            assert {k: m.final() for k, m in rank_out[key].items()} == first
        assert first["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-5)
        assert first["loss_tokens"] == float(tensors["loss_mask"].sum())
        masked = reference["logprobs"][tensors["loss_mask"] > 0]
        assert first["logprob_mean"] == pytest.approx(float(masked.mean()), abs=1e-5)
        assert first["logprob_min"] == pytest.approx(float(masked.min()), abs=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_same_weights(layout, layout_results, reference):
    for rank_out in layout_results(layout):
        err = max_rel_err(rank_out["weights"], reference["weights"])
        assert err < 1e-6, f"{layout}: weights after one step differ, relative error {err:.2e}"
        assert rank_out["step_info"]["grad_norm"] == pytest.approx(reference["step_info"]["grad_norm"], rel=1e-5)
        assert rank_out["step_info"]["lr"] == pytest.approx(LR)


@pytest.mark.parametrize("layout, variant", [("tp2", "sp"), ("pp2", "fixed_shapes")])
def test_variants(layout, variant, layout_results, reference):
    """TP2 with sequence parallelism (packs aligned to tp); PP2 with packs extended to one fixed length."""
    for rank_out in layout_results(layout):
        assert (rank_out[f"{variant}_forward"] - reference["logprobs"]).abs().max() < 1e-5
        err = max_rel_err(rank_out[f"{variant}_grad_budget"], reference["grads"])
        assert err < 1e-5, f"{layout} {variant}: gradient relative error {err:.2e}"
        assert rank_out[f"{variant}_metrics_budget"]["loss"].final() == pytest.approx(reference["loss"], rel=1e-5)


def test_checkpoint_roundtrip(reference):
    assert reference["ckpt_state"]["step"] == 3
    assert max_rel_err(reference["ckpt_restored"], reference["ckpt_saved"]) == 0.0


def test_frozen_reference_role(reference):
    assert (reference["frozen_logprobs"] - reference["logprobs"]).abs().max() < 1e-5
    assert reference["frozen_trainable"] == 0
    assert "role='policy'" in reference["frozen_fb"]


def test_lr_warmup_and_decay(reference):
    peak, floor, warmup, decay = LR, 0.01, 2, 4
    expected = []
    for k in range(1, 7):  # the k-th step uses the schedule's value at k
        if k <= warmup:
            expected.append(peak * k / warmup)
        elif k <= decay:
            expected.append(floor + (1 - (k - warmup) / (decay - warmup)) * (peak - floor))
        else:
            expected.append(floor)
    assert reference["lrs"] == pytest.approx(expected)


def test_reference_grad_norm_is_plain_norm(reference):
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in reference["grads"].values()))
    assert reference["step_info"]["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_deferred_finalization(layout_results, reference):
    for rank_out in layout_results("dp2"):
        err = max_rel_err(rank_out["halves_weights"], rank_out["weights"])
        assert err < 1e-6, f"halves + one step vs whole: relative error {err:.2e}"
        assert rank_out["halves_step_info"]["grad_norm"] == pytest.approx(rank_out["step_info"]["grad_norm"], rel=1e-5)


def test_dropping_a_scale_factor_breaks_invariance(layout_results, reference):
    for rank_out in layout_results("dp2"):
        for name in ("no_dp", "no_num_microbatches"):
            err = max_rel_err(rank_out[f"ablation_{name}"], reference["grads"])
            assert err > 0.3, f"dropping {name} should change the gradient (relative error {err:.2e})"


def test_distributed_optimizer_matches_single_process_adam(layout_results, reference):
    for rank_out in layout_results("dp2"):
        err = max_rel_err(rank_out["adam_weights"], reference["adam_weights"])
        assert err < 1e-6, f"distributed Adam vs single-process Adam: relative error {err:.2e}"


def test_broken_loss_raises_on_every_pipeline_stage(layout_results):
    for rank_out in layout_results("pp2"):
        assert rank_out["broken_loss"] == "KeyError 'no_such_key'", rank_out["broken_loss"]


def test_bad_inputs_raise_value_error_naming_the_field(reference, layout_results):
    cases = reference["bad_inputs"]
    assert "sequences" in cases["token_id"] and "vocab_size" in cases["token_id"]
    assert "vocab_size" in cases["negative_token_id"]
    assert "max_position_embeddings" in cases["too_long"]
    assert "loss_mask" in cases["loss_mask_shape"]
    assert "attention_mask" in cases["attention_mask_shape"]
    assert cases["zero_mask_loss"] == 0.0 and math.isfinite(cases["zero_mask_loss"])
    assert cases["zero_mask_grad_max"] == 0.0
    for rank_out in layout_results("dp2"):  # every rank raised, and the ranks still work together afterwards
        assert "vocab_size" in rank_out["bad_input"]
        assert (rank_out["after_bad_input"] - reference["logprobs"]).abs().max() < 1e-5
