"""MoE routing replay (R2, R3; model/router_replay.py): the routing megatron actually uses in training equals the
recorded (or the rollout's) routing, token by token and layer by layer, whatever the weights and the packing.

The reference is ``RoutingSpy``: forward hooks on the routers capture the ``routing_map [T, E]`` megatron-core
dispatches with, and a plain loop maps each packed position back to (row, column) of the ``[B, S]`` block (an
independent version of ``ReplayCall.router_tokens``). Layouts: one process (recording with 1 micro-batch,
training with 3: re-packing), EP2 (2 ranks, DP2, 1 and 3 micro-batches), and the replayed log-probs under CP2
and TP2 with sequence parallelism against the single process (the token slicing of CP and SP).

Planted bug: replay data handed to the routers in reversed token order must give a routing different from the
recording (the spy check fails), while the code as written gives zero differences.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.support.batches import full_grads, left_padded_tensors, micro_batch_size, summed_pg_loss, training_batch
from tests.support.multirank import run_ranks
from tests.support.reference import layout_fixture, reference_fixtures

PROMPT_LENS = [3, 9, 2, 5, 12, 4, 6, 7]
RESPONSE_LENS = [6, 2, 11, 4, 1, 8, 5, 3]
NUM_EXPERTS, TOPK, LAYERS = 4, 2, 2
PAIRS = (sum(PROMPT_LENS) + sum(RESPONSE_LENS)) * LAYERS  # (token, layer) pairs of the batch
LOGPROB_TOLERANCE = 1e-5  # fp32 sums in another order (packing, TP/CP all-reduces): ~1e-7 measured


def replay_config(replay: str = "r2", tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                  sequence_parallel: bool = False):
    from megatron_rl.config import MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                expert_model_parallel_size=ep, sequence_parallel=sequence_parallel),
        model=ModelConfig(attention_backend="local", num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                          moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_router_replay=replay),
        optimizer=OptimizerConfig(optimizer="sgd", lr=0.05),
        seed=1234,
    )


class RoutingSpy:
    """The routing megatron dispatches with, as ``[B, S, L, k]`` sorted expert ids (-1: not seen on this rank).

    Wraps ``schedule.forward_step`` to know each micro-batch and hooks every router's forward output
    ``(probs, routing_map [T, E])``; valid only where the router sees the whole pack (no CP, no SP)."""

    def __init__(self, policy):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in policy.module.modules() if isinstance(m, TopKRouter)]
        self.seen: list[tuple] = []

    @contextlib.contextmanager
    def capture(self, num_rows: int, width: int):
        from megatron_rl.model import schedule

        original, current, self.seen = schedule.forward_step, [], []

        def forward_step(data_iterator, model, **kwargs):
            current[:] = [next(data_iterator)]
            return original(iter(current), model, **kwargs)

        def hook(router, inputs, output):
            self.seen.append((current[0], router.layer_number - 1, output[1].detach().cpu()))

        handles = [r.register_forward_hook(hook) for r in self.routers]
        schedule.forward_step = forward_step
        table = torch.full((num_rows, width, LAYERS, TOPK), -1, dtype=torch.long)
        try:
            yield table
        finally:
            schedule.forward_step = original
            for h in handles:
                h.remove()
        for item, layer, routing_map in self.seen:
            cu, lens = item.packed.cu_seqlens.tolist(), item.packed.seq_lens.tolist()
            for j, row in enumerate(item.rows):
                if row >= num_rows:
                    continue
                for t in range(lens[j]):
                    experts = routing_map[cu[j] + t].nonzero()[:, 0]
                    table[row, width - lens[j] + t, layer] = experts  # top-k distinct experts, sorted
        return table


def differing(spy_table: torch.Tensor, routing: torch.Tensor) -> tuple[int, int]:
    """(token, layer) pairs whose expert set differs between the spy and ``routing``, and pairs compared."""
    seen = spy_table[..., 0] >= 0
    want = routing.long().sort(dim=-1).values
    return int(((spy_table != want).any(dim=-1) & seen).sum()), int(seen.sum())


def perturb_routers(policy, scale: float, seed: int) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(seed)
    for router in policy.module.modules():
        if isinstance(router, TopKRouter):
            with torch.no_grad():
                router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale)


def random_routing(attention_mask: torch.Tensor, seed: int) -> torch.Tensor:
    """A rollout's routing ``[B, S, L, k]``: k distinct random experts per token and layer (0 on padding)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*attention_mask.shape, LAYERS, NUM_EXPERTS, generator=g)
    return scores.topk(TOPK, dim=-1).indices.to(torch.uint8) * attention_mask[..., None, None].to(torch.uint8)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, 128, g, loss_drop=0.2, advantages=True)


def _router_grads(policy) -> dict[str, float]:
    grads = full_grads(policy)
    return {k: float(v.norm()) for k, v in grads.items() if k.endswith("router.weight")}


def _train(policy, batch, spy: RoutingSpy | None, count: int, dp: int = 1):
    policy.config.batch.micro_batch_size = micro_batch_size(len(batch), dp, count)
    capture = spy.capture(len(batch), batch["sequences"].shape[1]) if spy else contextlib.nullcontext()
    with capture as seen:
        metrics = policy.forward_backward(batch, summed_pg_loss, None)
    policy.finalize_grads()
    grads = _router_grads(policy)
    policy.zero_grad()
    return seen, {k: m.final() for k, m in metrics.items()}, grads


def _single_rank(rank, world_size, tensors):
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model import router_replay
    from megatron_rl.model.policy import MegatronPolicy

    cfg = replay_config()
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    reference = MegatronPolicy(replay_config(), groups, role="reference")
    reference.load_full_state_dict(policy.full_state_dict())
    spy, out = RoutingSpy(policy), {}
    batch = training_batch(tensors)
    num_rows, width = len(batch), batch["sequences"].shape[1]
    ref_before = reference.forward(batch)["logprobs"]

    policy.config.batch.micro_batch_size = len(batch)  # record with one micro-batch
    with spy.capture(num_rows, width) as seen:
        recorded = policy.forward(batch, record_routing=True)["routed_experts"]
    out["recorded"], out["spy_recording"] = recorded, seen
    perturb_routers(policy, 0.5, seed=1)  # the weights move between the recording and the training forward
    out["full_sd"] = {k: v.clone() for k, v in policy.full_state_dict().items()}
    policy.config.batch.micro_batch_size = 2
    out["recorded_perturbed"] = policy.forward(batch, record_routing=True)["routed_experts"]

    replayed = training_batch(tensors)
    replayed["routed_experts"] = recorded
    out["spy_replay"], out["replay_metrics"], out["replay_grads"] = _train(policy, replayed, spy, 3)
    out["spy_free"], out["free_metrics"], _ = _train(policy, training_batch(tensors), spy, 3)
    policy.config.batch.micro_batch_size = 3
    out["replay_logprobs"] = policy.forward(replayed)["logprobs"]
    out["free_logprobs"] = policy.forward(training_batch(tensors))["logprobs"]

    # The reference model shares megatron's global RouterReplay list: it neither consumed nor recorded anything.
    out["reference_unchanged"] = bool(torch.equal(reference.forward(replayed)["logprobs"], ref_before))
    out["replay_state_clear"] = all(r.router_replay_action is None and r.target_topk_idx is None
                                    and r.recorded_topk_idx is None
                                    for r in router_replay.RouterReplay.global_router_replay_instances)

    # R3: a rollout's routing (random, unlike anything the model would choose) is replayed exactly.
    rollout = training_batch(tensors)
    rollout["routed_experts"] = random_routing(rollout["attention_mask"], seed=2)
    out["r3_routing"] = rollout["routed_experts"]
    out["spy_r3"], _, _ = _train(policy, rollout, spy, 2)
    with spy.capture(num_rows, width) as seen:
        policy.forward(rollout)
    out["spy_r3_forward"] = seen

    # Planted bug: the replay data in reversed token order.
    original = router_replay.ReplayCall.router_tokens
    router_replay.ReplayCall.router_tokens = lambda self, item: tuple(x.flip(0) for x in original(self, item))
    try:
        out["spy_planted"], _, _ = _train(policy, replayed, spy, 3)
    finally:
        router_replay.ReplayCall.router_tokens = original
    return out


def _layout_rank(rank, world_size, layout, spy_applies, tensors, single):
    """One layout from the single process's perturbed weights: record, replay (1 and 3 micro-batches), log-probs."""
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    cfg = replay_config(**layout)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    policy.load_full_state_dict(single["full_sd"])
    batch = training_batch(tensors)
    policy.config.batch.micro_batch_size = micro_batch_size(len(batch), groups.dp_size, 3)
    out = {"recorded": policy.forward(batch, record_routing=True)["routed_experts"]}
    replayed = training_batch(tensors)
    replayed["routed_experts"] = single["recorded"]
    out["replay_logprobs"] = policy.forward(replayed)["logprobs"]
    spy = RoutingSpy(policy) if spy_applies else None
    for count in (1, 3):
        out[f"spy_{count}"], out[f"metrics_{count}"], out[f"grads_{count}"] = _train(
            policy, replayed, spy, count, groups.dp_size)
    return out


LAYOUTS = {  # name: (world size, parallel sizes, whether every router sees the whole pack: the spy applies)
    "ep2": (2, {"ep": 2}, True),  # DP2: each rank replays its own rows
    "pp2": (2, {"pp": 2}, True),  # one layer per stage: the table's layer index
    "cp2": (2, {"cp": 2}, False),  # the router sees chunks r and 2cp-1-r of each sequence
    "tp2sp": (2, {"tp": 2, "sequence_parallel": True}, False),  # the router sees the TP rank's slice
}


def _run_layout(name, tensors, single):
    world, layout, spy_applies = LAYOUTS[name]
    return run_ranks(world, _layout_rank, layout, spy_applies, tensors, single, timeout=600)


layout_results = layout_fixture(_run_layout, reference="single")


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_across_layouts(layout, layout_results, single):
    """Recording equals the single process's (same weights); the replayed log-probs equal its replayed
    log-probs (and differ from the free ones: a token-slicing error would show); where the spy applies, the
    routing used in training is the replayed one on every rank, for 1 and 3 micro-batches."""
    results = layout_results(layout)
    spy_applies = LAYOUTS[layout][2]
    for rank, out in enumerate(results):
        assert torch.equal(out["recorded"], single["recorded_perturbed"]), (layout, rank)
        err = float((out["replay_logprobs"] - single["replay_logprobs"]).abs().max())
        assert err < LOGPROB_TOLERANCE, (layout, rank, err)
        for count in (1, 3):
            assert all(g > 0 for g in out[f"grads_{count}"].values()) and out[f"grads_{count}"], (layout, count)
            frac = out[f"metrics_{count}"]["moe/replay_topk_mismatch_frac"]
            assert frac == pytest.approx(single["replay_metrics"]["moe/replay_topk_mismatch_frac"]), (layout, count)
            if spy_applies:
                changed, total = differing(out[f"spy_{count}"], single["recorded"])
                assert changed == 0 and total > 0, (layout, rank, count, changed)
    assert float((single["free_logprobs"] - single["replay_logprobs"]).abs().max()) > 100 * LOGPROB_TOLERANCE


tensors, single = reference_fixtures(_tensors, _single_rank, timeout=600, name="single")


@pytest.mark.slow
@pytest.mark.multirank
def test_recording_is_the_routing_used(single):
    changed, total = differing(single["spy_recording"], single["recorded"])
    assert total == PAIRS and total > 0
    assert changed == 0


@pytest.mark.slow
@pytest.mark.multirank
def test_replay_keeps_recorded_routing_after_router_change(single):
    replay_changed, total = differing(single["spy_replay"], single["recorded"])
    free_changed, _ = differing(single["spy_free"], single["recorded"])
    print(f"(token, layer) pairs changed vs the recording: replay {replay_changed}/{total}, "
          f"without replay {free_changed}/{total}; replay metric {single['replay_metrics']}")
    assert replay_changed == 0
    assert free_changed > total // 10  # the perturbation moves many tokens to other experts
    frac = single["replay_metrics"]["moe/replay_topk_mismatch_frac"]
    assert 0 < frac < 1
    assert "moe/replay_topk_mismatch_frac" not in single["free_metrics"]
    grads = single["replay_grads"]
    assert len(grads) == LAYERS and all(g > 0 for g in grads.values()), grads  # the router still learns
    assert not torch.allclose(single["replay_logprobs"], single["free_logprobs"], atol=1e-3)


@pytest.mark.slow
@pytest.mark.multirank
def test_reference_model_untouched_and_state_cleared(single):
    assert single["reference_unchanged"]
    assert single["replay_state_clear"]


@pytest.mark.slow
@pytest.mark.multirank
def test_r3_rollout_routing_replayed_exactly(single):
    for name in ("spy_r3", "spy_r3_forward"):
        changed, total = differing(single[name], single["r3_routing"])
        assert total == PAIRS and changed == 0, name


@pytest.mark.slow
@pytest.mark.multirank
def test_planted_reversed_token_order_fails(single):
    changed, total = differing(single["spy_planted"], single["recorded"])
    print(f"planted bug (reversed token order): {changed}/{total} (token, layer) pairs differ")
    assert changed > total // 10


# ------------------------------------------------------------------------------------------------ the RL step


def _trainer_rank(rank, world_size, replay: str):
    """One RL step (2 epochs, 2 mini-batches) with rollouts from the built-in engine of an MoE policy."""
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    cfg = replay_config(replay)
    cfg.batch.update_epochs_per_batch = 2
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    policy = MegatronPolicy(cfg, groups)
    engine = BuiltinEngine.from_policy(policy, pad_token_id=0)
    prompts = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10], [11, 12, 13, 14], [11, 12, 13, 14], [3], [3]]
    completions = engine.generate(prompts, SamplingSpec(max_tokens=6), seed=3)
    rollouts = {
        "prompt_token_ids": prompts, "response_ids": [c.token_ids for c in completions],
        "rewards": [float(i % 3) for i in range(len(prompts))], "loss_masks": [[1] * len(c.token_ids) for c in completions],
        "uids": [i // 2 for i in range(len(prompts))], "rollout_logprobs": [c.logprobs for c in completions],
    }
    routing = [c.extra.get("routed_experts") for c in completions]
    if replay == "r3":
        rollouts["routed_experts"] = routing
    metrics = Trainer(cfg, policy).train_step(rollouts)
    return {"metrics": metrics, "routing": routing, "lengths": [len(p) + len(c.token_ids)
                                                             for p, c in zip(prompts, completions)]}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_trainer_step_with_replay(replay):
    out = run_ranks(1, _trainer_rank, replay, timeout=600)[0]
    metrics = out["metrics"]
    print(replay, {k: v for k, v in metrics.items() if k.startswith(("moe/", "rollout/"))})
    assert 0 <= metrics["moe/replay_topk_mismatch_frac"] < 1
    if replay == "r3":
        assert [r.shape for r in out["routing"]] == [(n, LAYERS, TOPK) for n in out["lengths"]]
        # the old log-probs replay the engine's routing (the same weights): no worse than routing freely
        assert metrics["moe/replay_logprob_abs_diff_mean"] <= metrics["moe/noreplay_logprob_abs_diff_mean"] + 1e-6
    else:
        assert out["routing"] == [None] * len(out["routing"]) and "moe/replay_logprob_abs_diff_mean" not in metrics


# ------------------------------------------------------------------------------------------------ validation (no ranks)


def _rollouts(routing):
    return {"prompt_token_ids": [[1, 2], [3]], "response_ids": [[4], [5, 6]], "rewards": [1.0, 0.0],
            "loss_masks": [[1], [1, 1]], "uids": [0, 1], "routed_experts": routing}


def _routing(lengths=(3, 3), layers=LAYERS, topk=TOPK, dtype=torch.int64, high=NUM_EXPERTS):
    return [torch.randint(0, high, (n, layers, topk), dtype=dtype) for n in lengths]


@pytest.mark.parametrize("routing, message", [
    (_routing(lengths=(3, 2)), r"routed_experts'\]\[1\] has shape \(2, 2, 2\), expected .* \(3, 2, 2\)"),
    (_routing(layers=3), r"routed_experts'\]\[0\] has shape \(3, 3, 2\)"),
    (_routing(topk=1), r"routed_experts'\]\[0\] has shape \(3, 2, 1\)"),
    (_routing(high=NUM_EXPERTS + 5) + [], r"routed_experts'\]\[\d\] holds expert ids in \[\d+, \d+\], outside \[0, "),
    (_routing(dtype=torch.float32), r"routed_experts'\]\[0\] is a 3-d float32 array, expected integer"),
    ([[1, 2, 3], [4, 5, 6]], r"routed_experts'\]\[0\] is a 1-d int64 array"),
])
def test_bad_routed_experts_is_a_value_error(routing, message):
    from megatron_rl.data.generator_output import validate_generator_output

    torch.manual_seed(0)
    if "outside" in message:
        routing[0][0, 0, 0] = NUM_EXPERTS + 1
    with pytest.raises(ValueError, match=message):
        validate_generator_output(_rollouts(routing), step_wise=False, routing=(LAYERS, TOPK, NUM_EXPERTS))


def test_routed_experts_convert_left_padded_and_merge():
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.data.merge import merge_stepwise_output

    routing = _routing()
    batch = TrainingBatch.from_generator_output(_rollouts(routing), pad_token_id=0)
    table = batch["routed_experts"]
    assert table.shape == (2, 3, LAYERS, TOPK) and table.dtype == torch.uint8
    assert torch.equal(table[0], routing[0].to(torch.uint8)) and torch.equal(table[1], routing[1].to(torch.uint8))
    steps = {"prompt_token_ids": [[1, 2], [1, 2, 4, 7]], "response_ids": [[4], [8]], "rewards": [0.0, 1.0],
             "loss_masks": [[1], [1]], "uids": [0, 0], "trajectory_ids": [0, 0], "is_last_step": [False, True],
             "routed_experts": _routing(lengths=(3, 5))}
    merged, counts = merge_stepwise_output(steps)
    assert counts["num_seq_after_merge"] == 1
    assert merged["routed_experts"][0] is steps["routed_experts"][1] or (merged["routed_experts"][0] == steps[
        "routed_experts"][1].numpy()).all()
