"""Mixture-of-experts Hugging Face checkpoints in and out of MegatronPolicy, against transformers itself.

Test models (``make_tiny_moe``, saved locally, no downloads): 2 layers, hidden 64, 4 heads, 2 KV heads, head_dim
16, 4 experts, top-2, expert width 32, vocab 128, fp32: Qwen3-MoE with ``norm_topk_prob`` False and True
(megatron's ``moe_router_pre_softmax`` True and False), and Mixtral (no q/k norms, ``block_sparse_moe.experts.{e}.
w1/w2/w3`` names, always renormalized). Norm weights are perturbed away from 1 and the router weights drawn with
std 0.15 (router logits of order 1), so that a wrong mapping, including experts placed under the wrong global
index, changes the routing or the expert outputs and cannot hide.

Single process: the config mapping and its errors, ``hf_config_for`` round trip, and megatron-core's top-k
routing against transformers' router on random logits (the ``moe_router_pre_softmax = not norm_topk_prob``
claim of hf/config.py).

One 2-rank spawn visits EP1 (DP2), EP2, EP2 with TP2 (parallel folding: the EP group is the TP group), TP2 (EP1)
and PP2 and, for each model: imports the HF safetensors (``policy_from_hf``), runs ``MegatronPolicy.forward``
(packed THD) on a left-padded batch, exports back to HF (``export_policy_to_hf``), and collects mbridge's full
export (``iter_hf_weights``) and the weight sync's per-stage stream (``iter_stage_hf_weights``). It also plants a
bug at EP2: each EP rank loads the experts of its *local* index (rank 1 gets experts 0, 1 instead of 2, 3).
The parent compares per-token response log-probs with transformers' forward on the same batch, the exported
safetensors with the source (bitwise), reloads the export in transformers, and checks that the stage streams,
concatenated in stage order, are mbridge's full export tensor by tensor. A 4-rank spawn does EP2 x PP2.

Tolerance 1e-5 for log-probs: fp32 with the same weights, only summation order differs (attention, the expert
sum over the top-k in a different order, the all-to-all), which moves log-probs by ~1e-6 (the dense parity tests
measured <= 1e-6); a routing decision that flipped would move them by ~1e-2 or more.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from tests.support.batches import left_padded_tensors, training_batch
from tests.support.exports import assert_same_weights
from tests.support.multirank import run_ranks

VOCAB = 128
NUM_EXPERTS = 4
PROMPT_LENS = [5, 2, 9, 3]
RESPONSE_LENS = [4, 7, 1, 6]
LAYOUTS = {  # name: (tp, pp, ep) on 2 ranks
    "ep1dp2": (1, 1, 1),
    "ep2": (1, 1, 2),
    "tp2ep2": (2, 1, 2),
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
}
VARIANTS = {  # name: (model_type, extra config)
    "renorm": ("qwen3_moe", {"norm_topk_prob": True}),
    "no_renorm": ("qwen3_moe", {"norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
}
TOL = 1e-5


def tiny_moe_config(model_type: str = "qwen3_moe", **extra):
    from transformers import AutoConfig

    if model_type == "qwen3_moe":
        experts = dict(num_experts=NUM_EXPERTS, moe_intermediate_size=32, intermediate_size=96)
    else:  # mixtral: intermediate_size is the experts' width
        experts = dict(num_local_experts=NUM_EXPERTS, intermediate_size=32, sliding_window=None)
    kwargs = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, pad_token_id=0, **experts,
    )  # fmt: skip
    kwargs.update(extra)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_moe(path: Path, model_type: str = "qwen3_moe", seed: int = 0, **extra) -> Path:
    """A random tiny MoE model saved to ``path`` (safetensors + config.json; no tokenizer: tests pass the pad id)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(model_type, **extra), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".gate.weight"):  # router: logits of order 1, clear top-k margins
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {name: make_tiny_moe(root / name, model_type, seed=i, **extra)
            for i, (name, (model_type, extra)) in enumerate(VARIANTS.items())}


def _batch_tensors() -> dict[str, torch.Tensor]:
    return left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, VOCAB, torch.Generator().manual_seed(0), low=3)


def hf_response_logprobs(hf_dir: Path, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' fp32 log-probs of the response tokens: ``[B, R]`` (the last R targets of each row)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tensors["sequences"], attention_mask=tensors["attention_mask"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    token = logp.gather(-1, tensors["sequences"][:, 1:, None]).squeeze(-1)
    return token[:, -tensors["response_mask"].shape[1]:]


@functools.lru_cache(maxsize=None)
def _hf_reference(hf_dir: str) -> torch.Tensor:
    return hf_response_logprobs(Path(hf_dir), _batch_tensors())


# ---------------------------------------------------------------------- single process


def test_model_config_from_moe_checkpoints(moe_models):
    from megatron_rl.config import ModelConfig
    from megatron_rl.hf.config import model_config_from_hf

    for name, (model_type, extra) in VARIANTS.items():
        base = ModelConfig(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01)
        cfg = model_config_from_hf(moe_models[name], base=base)
        assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk) == (NUM_EXPERTS, 32, 2)
        assert cfg.moe_router_pre_softmax == (not extra.get("norm_topk_prob", True))  # Mixtral: renormalized
        assert cfg.qk_layernorm == (model_type == "qwen3_moe") and not cfg.add_qkv_bias and cfg.kv_channels == 16
        assert cfg.moe_router_score_function == "softmax" and cfg.moe_aux_loss_coeff == 0.01  # a training choice


def _edit(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    data = json.loads((src / "config.json").read_text())
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_dense_layers_among_moe_layers_are_refused(moe_models, tmp_path):
    from megatron_rl.hf.config import model_config_from_hf

    src = moe_models["renorm"]
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        model_config_from_hf(_edit(src, tmp_path / "sparse2", decoder_sparse_step=2))
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        model_config_from_hf(_edit(src, tmp_path / "dense1", mlp_only_layers=[1]))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_hf_config_for_moe_round_trips(tmp_path, pre_softmax):
    from megatron_rl.config import ModelConfig
    from megatron_rl.hf.config import model_config_from_hf, write_hf_config

    cfg = ModelConfig(num_moe_experts=8, moe_ffn_hidden_size=24, moe_router_topk=3, qk_layernorm=True,
                      moe_router_pre_softmax=pre_softmax, kv_channels=32)
    hf = json.loads((write_hf_config(cfg, tmp_path) / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["norm_topk_prob"] == (not pre_softmax)
    back = model_config_from_hf(tmp_path, base=cfg)
    assert back == dataclasses.replace(cfg, hf_path=str(tmp_path), family="moe")


def test_hf_config_for_moe_without_qk_norm_is_mixtral_or_refused(tmp_path):
    from megatron_rl.config import ModelConfig
    from megatron_rl.hf.config import hf_config_for, model_config_from_hf, write_hf_config

    assert hf_config_for(ModelConfig(num_moe_experts=4)).model_type == "mixtral"
    with pytest.raises(ValueError, match="moe_router_pre_softmax=True without qk_layernorm"):
        hf_config_for(ModelConfig(num_moe_experts=4, moe_router_pre_softmax=True))
    # Mixtral has one intermediate size (the experts'): ffn_hidden_size comes back as moe_ffn_hidden_size
    mixtral = ModelConfig(num_moe_experts=4, ffn_hidden_size=24, moe_ffn_hidden_size=24, kv_channels=16)
    hf_dir = write_hf_config(mixtral, tmp_path)
    assert model_config_from_hf(hf_dir, base=mixtral) == dataclasses.replace(mixtral, hf_path=str(hf_dir), family="moe")
    with pytest.raises(ValueError, match="moe_router_score_function='sigmoid'"):
        hf_config_for(ModelConfig(num_moe_experts=4, qk_layernorm=True, moe_router_score_function="sigmoid"))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_megatron_topk_routing_equals_transformers_router(norm_topk_prob):
    """megatron-core's routing with ``moe_router_pre_softmax = not norm_topk_prob`` gives transformers' expert
    choice and weights. Tolerance 1e-6: the same fp32 softmax, normalized over 4 or over 2 entries (~1 ulp)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_moe_config(norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        hidden = torch.randn(512, config.hidden_size, generator=generator)
        logits, weights, indices = router(hidden)
    probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=not norm_topk_prob,
                                                          score_function="softmax")
    expected = torch.zeros_like(logits).scatter_(1, indices, weights)
    assert torch.equal(routing_map, expected > 0)
    assert (probs - expected).abs().max().item() < 1e-6
    # and the other setting is really different (so the mapping matters)
    other, _ = topk_routing_with_score_function(logits, 2, use_pre_softmax=norm_topk_prob, score_function="softmax")
    assert (other - expected).abs().max().item() > 0.05


# ---------------------------------------------------------------------- runs in the children


def _parallel(tp: int, pp: int, ep: int):
    from megatron_rl.config import ParallelConfig

    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                          sequence_parallel=tp > 1)  # megatron-core's MoE layer needs SP under TP


def _policy(parallel, hf_dir: str, groups):
    from megatron_rl.config import MegatronRLConfig, ModelConfig
    from megatron_rl.hf.weights import policy_from_hf

    config = MegatronRLConfig(parallel=parallel, model=ModelConfig(attention_backend="local"))
    return policy_from_hf(config, groups, role="reference", hf_dir=hf_dir, pad_token_id=0)


def _streams(policy, hf_dir: str, groups) -> dict:
    """mbridge's full export and this rank's per-stage stream (both on CPU)."""
    from megatron_rl.hf.weights import iter_hf_weights, iter_stage_hf_weights

    reference = list(iter_hf_weights([policy.module], hf_dir, groups))
    stage = [(n, t.detach().to("cpu", copy=True)) for n, t in iter_stage_hf_weights([policy.module], hf_dir, groups)]
    return {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "ep_rank": groups.ep_rank,
            "reference": reference, "stage": stage}


def _layout_run(layout: str, parallel, model_dirs: dict[str, str], tensors, export_root: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.weights import export_policy_to_hf

    groups = initialize_distributed(parallel, seed=7)
    batch = training_batch(tensors)
    out = {}
    for variant, path in model_dirs.items():
        policy = _policy(parallel, path, groups)
        out[(variant, "logprobs")] = policy.forward(batch)["logprobs"]
        export_policy_to_hf(policy, Path(export_root) / f"{layout}_{variant}")
        out[(variant, "streams")] = _streams(policy, path, groups)
    parallel_state.destroy_model_parallel()
    return out


def _planted_local_expert_index(parallel, hf_dir: str, tensors) -> torch.Tensor:
    """Planted bug at EP2: the bridge maps local expert j to global expert j on every EP rank (EP ignored)."""
    from megatron.core import parallel_state

    import megatron_rl.hf.mbridge as hf_weights  # the mbridge converter's module
    from megatron_rl.distributed.bootstrap import initialize_distributed

    make_bridge = hf_weights.make_bridge

    def ep_blind_bridge(*args, **kwargs):
        bridge = make_bridge(*args, **kwargs)
        local_to_global = bridge._weight_name_mapping_mcore_local_to_global
        bridge._weight_name_mapping_mcore_local_to_global = lambda model, consider_ep=True: local_to_global(
            model, consider_ep=False)
        return bridge

    groups = initialize_distributed(parallel, seed=7)
    hf_weights.make_bridge = ep_blind_bridge
    try:
        logprobs = _policy(parallel, hf_dir, groups).forward(training_batch(tensors))["logprobs"]
    finally:
        hf_weights.make_bridge = make_bridge
    parallel_state.destroy_model_parallel()
    return logprobs


def _moe_child(rank: int, world_size: int, model_dirs: dict[str, str], tensors, export_root: str) -> dict:
    results = {}
    for layout, (tp, pp, ep) in LAYOUTS.items():
        for key, value in _layout_run(layout, _parallel(tp, pp, ep), model_dirs, tensors, export_root).items():
            results[(layout, *key)] = value
    results["planted"] = _planted_local_expert_index(_parallel(1, 1, 2), model_dirs["renorm"], tensors)
    return results


def _pp_ep_child(rank: int, world_size: int, hf_dir: str) -> dict:
    from megatron_rl.distributed.bootstrap import initialize_distributed

    parallel = _parallel(1, 2, 2)
    groups = initialize_distributed(parallel, seed=7)
    return _streams(_policy(parallel, hf_dir, groups), hf_dir, groups)


# ---------------------------------------------------------------------- tests (parent)


@pytest.fixture(scope="module")
def moe_run(moe_models, tmp_path_factory):
    export_root = tmp_path_factory.mktemp("hf_moe_export")
    tensors = _batch_tensors()
    dirs = {name: str(path) for name, path in moe_models.items()}
    results = run_ranks(2, _moe_child, dirs, tensors, str(export_root), timeout=600)
    return results, tensors, export_root


def _max_diff(logprobs: torch.Tensor, reference: torch.Tensor, tensors) -> float:
    return (logprobs - reference)[tensors["response_mask"].bool()].abs().max().item()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logprobs_match_transformers(moe_run, moe_models, layout):
    results, tensors, _ = moe_run
    for variant, path in moe_models.items():
        for rank, per_rank in enumerate(results):  # every rank returns the whole batch's log-probs
            diff = _max_diff(per_rank[(layout, variant, "logprobs")], _hf_reference(str(path)), tensors)
            print(f"{layout} {variant} rank {rank}: max |logprob diff| {diff:.2e}")
            assert diff <= TOL, (layout, variant, rank, diff)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_export_is_bitwise_and_loads_in_transformers(moe_run, moe_models, layout):
    _, tensors, export_root = moe_run
    for variant, src in moe_models.items():
        out = export_root / f"{layout}_{variant}"
        source = assert_same_weights(src, out, (layout, variant))
        assert sum(".experts." in name for name in source) == 2 * 3 * NUM_EXPERTS  # 2 layers, 3 per expert
        assert torch.equal(hf_response_logprobs(out, tensors), _hf_reference(str(src)))


@pytest.mark.slow
@pytest.mark.multirank
def test_planted_bug_wrong_global_expert_index_fails(moe_run, moe_models):
    results, tensors, _ = moe_run
    diff = _max_diff(results[0]["planted"], _hf_reference(str(moe_models["renorm"])), tensors)
    print(f"planted bug (EP2, local expert index used as global): max |logprob diff| {diff:.3f}")
    assert diff > 1000 * TOL, diff


def _check_stage_streams(per_rank: list[dict], where) -> None:
    """The stream roots' stage streams (TP rank 0 and EP rank 0), concatenated in stage order, equal mbridge's
    full export (names, order, dtypes, values bitwise); every other rank yields nothing."""
    reference = per_rank[0]["reference"]
    for r in per_rank[1:]:
        assert [n for n, _ in r["reference"]] == [n for n, _ in reference], where
    roots = [r for r in per_rank if r["tp_rank"] == 0 and r["ep_rank"] == 0]
    for r in per_rank:
        if not (r["tp_rank"] == 0 and r["ep_rank"] == 0):
            assert r["stage"] == [], (where, "a rank that is not a stream root yielded")
    by_stage = {}
    for r in roots:
        by_stage.setdefault(r["pp_rank"], []).append(r)
    pp = max(by_stage) + 1
    for copy in range(len(by_stage[0])):  # several roots per stage stream the same (e.g. DP2 at EP1)
        got = [item for stage in range(pp) for item in by_stage[stage][copy]["stage"]]
        assert [n for n, _ in got] == [n for n, _ in reference], where
        for (name, ours), (_, theirs) in zip(got, reference):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (where, name)
    experts = [n for n, _ in reference if ".experts." in n]
    assert len(experts) == 2 * 3 * NUM_EXPERTS, where


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_stage_stream_is_mbridge_export(moe_run, moe_models, layout):
    results, _, _ = moe_run
    for variant in moe_models:
        _check_stage_streams([r[(layout, variant, "streams")] for r in results], (layout, variant))


@pytest.mark.slow
@pytest.mark.multirank
def test_moe_stage_stream_ep2_pp2(moe_models):
    per_rank = run_ranks(4, _pp_ep_child, str(moe_models["no_renorm"]), timeout=600)
    assert sorted((r["pp_rank"], r["ep_rank"]) for r in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_stage_streams(per_rank, "ep2pp2")
