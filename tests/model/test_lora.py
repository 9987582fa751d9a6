"""LoRA in the trainer (docs/LORA.md): step 0 is the base, only the adapters train, and one step's loss, adapter
gradients, grad norm and updated adapters do not depend on the TP/PP/DP/CP/SP split or the micro-batching.

The reference is the single-process LoRA policy, in this process, with random adapters (B is zero at init,
where A would get no gradient). The layouts run in ONE 2-rank spawn, one after the other (megatron's parallel
state is rebuilt between them): TP2 (1 and 2 micro-batches), TP2 with sequence parallelism, PP2 (1 and 3
micro-batches), DP2 (plus the distributed optimizer) and CP2; a LoRA checkpoint saved under TP2 resumes in place
and under CP2. (Two ranks, not four: on the 2-core CI machine four ranks took twice as long.) Tolerance 1e-5 relative (L2 over the adapters), as for
full fine-tuning (tests/model/test_policy_multirank.py): fp32 sums in another order differ at ~1e-7.
Planted bugs that fail it (checked by hand): the sequence-parallel mark on the whole factor dropped (TP2+SP:
gradient error 0.57), the row-parallel all-reduce of ``A_r x_r`` dropped (TP2: the loss is wrong).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.batches import left_padded_tensors, max_rel_err, micro_batch_size, summed_pg_loss, training_batch
from tests.support.lora_helpers import adapter_grads, adapters_only, randomize_adapters
from tests.support.multirank import run_ranks

RANK = 8
PROMPT_LENS = [3, 9, 2, 5, 12, 4, 6]
RESPONSE_LENS = [6, 2, 11, 4, 1, 8, 5]  # B=7 is odd: DP2 adds a dummy row
TOLERANCE = 1e-5


def lora_config(tp: int = 1, pp: int = 1, cp: int = 1, *, sequence_parallel: bool = False, rank: int = RANK,
                optimizer: str = "sgd", distributed: bool = False):
    from megatron_rl.config import LoraConfig, MegatronRLConfig, ModelConfig, OptimizerConfig, ParallelConfig

    return MegatronRLConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                context_parallel_size=cp, sequence_parallel=sequence_parallel),
        model=ModelConfig(attention_backend="local", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, vocab_size=64, max_position_embeddings=128,
                          qk_layernorm=True, lora=LoraConfig(rank=rank, alpha=2.0 * rank) if rank else LoraConfig()),
        optimizer=OptimizerConfig(optimizer=optimizer, lr=0.05, clip_grad=0.0, use_distributed_optimizer=distributed),
        seed=1234,
    )


def batch_tensors() -> dict[str, torch.Tensor]:
    return left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, 64, torch.Generator().manual_seed(0), loss_drop=0.2,
                               advantages=True)


def _policy(cfg, groups, full_sd):
    from megatron_rl.model.policy import MegatronPolicy

    policy = MegatronPolicy(cfg, groups)
    policy.load_full_state_dict(full_sd)
    return policy


def _grads(policy, batch, dp_size: int, count: int) -> tuple[float, dict[str, torch.Tensor]]:
    policy.config.batch.micro_batch_size = micro_batch_size(len(batch), dp_size, count)
    loss = policy.forward_backward(batch, summed_pg_loss, None)["loss"].final()
    policy.finalize_grads()
    grads = adapter_grads(policy)
    policy.zero_grad()
    return loss, grads


def _step(policy, batch) -> tuple[float, dict[str, torch.Tensor]]:
    policy.forward_backward(batch, summed_pg_loss, None)
    grad_norm = policy.optim_step()["grad_norm"]
    return grad_norm, adapters_only(policy.full_state_dict())


# ---------------------------------------------------------------------- one process (in this process)


GROUPS_SEED = 1234  # the ``groups`` fixture's (tests/conftest.py)
GROUPS_PARALLEL = lora_config().parallel


@pytest.fixture(scope="module")
def reference(groups):
    """The single-process run from random adapters: loss, adapter grads, SGD and Adam steps."""
    from megatron_rl.model.policy import MegatronPolicy

    policy = MegatronPolicy(lora_config(), groups)
    randomize_adapters(policy.module, seed=5, rank=RANK)
    full_sd = policy.full_state_dict()
    batch = training_batch(batch_tensors())
    loss, grads = _grads(policy, batch, 1, 1)
    grad_norm, sgd = _step(_policy(lora_config(), groups, full_sd), batch)
    _, adam = _step(_policy(lora_config(optimizer="adam"), groups, full_sd), batch)
    return {"full_sd": full_sd, "loss": loss, "grads": grads, "grad_norm": grad_norm, "sgd": sgd, "adam": adam}


def test_step_zero_is_the_base_and_only_adapters_train(groups):
    from megatron_rl.model.lora import is_adapter_name
    from megatron_rl.model.policy import MegatronPolicy

    base = MegatronPolicy(lora_config(rank=0, optimizer="adam"), groups)
    policy = MegatronPolicy(lora_config(optimizer="adam"), groups)
    policy.load_full_state_dict(base.full_state_dict())  # a base dict: the adapters keep their init
    batch = training_batch(batch_tensors())
    assert torch.equal(policy.forward(batch)["logprobs"], base.forward(batch)["logprobs"])  # B = 0: bitwise

    trainable = [n for n, p in policy.module.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 HF modules, 2 layers
    adapter_numel = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
    assert sum(b.numel_unpadded for b in policy.model.buffers) == adapter_numel  # DDP buckets: adapters only
    optimized = [p for g in policy.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == adapter_numel  # no optimizer state for the base

    before = {k: v for k, v in policy.full_state_dict().items() if not is_adapter_name(k)}
    policy.forward_backward(batch, summed_pg_loss, None)
    policy.optim_step()
    after = policy.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the base must stay frozen"
    assert not torch.equal(policy.forward(batch)["logprobs"], base.forward(batch)["logprobs"])


# ---------------------------------------------------------------------- the layouts (one 2-rank spawn)

LAYOUTS = {  # name: (tp, pp, cp, sequence_parallel, micro-batch counts)
    "tp2": (2, 1, 1, False, (1, 2)),
    "tp2_sp": (2, 1, 1, True, (2,)),
    "pp2": (1, 2, 1, False, (1, 3)),
    "dp2": (1, 1, 1, False, (2,)),
    "cp2": (1, 1, 2, False, (2,)),
}


def _checkpoint_save(groups, batch, full_sd, save_dir) -> dict:
    """Under the first layout: a LoRA (Adam) checkpoint after one step, the next step after it, a resume in place
    (bitwise), and a full fine-tune's checkpoint."""
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint

    cfg = lora_config(2, optimizer="adam")
    policy = _policy(cfg, groups, full_sd)
    _step(policy, batch)
    save_checkpoint(policy, f"{save_dir}/lora", {"step": 1})
    out = {"ckpt_next": _step(policy, batch)}
    resumed = _policy(cfg, groups, base_only(full_sd))
    out["ckpt_state"] = load_checkpoint(resumed, f"{save_dir}/lora")
    out["ckpt_resumed_same_layout"] = _step(resumed, batch)
    full = _policy(lora_config(2, rank=0, optimizer="adam"), groups, base_only(full_sd))
    _step(full, batch)
    save_checkpoint(full, f"{save_dir}/full", {"step": 1})
    return out


def _checkpoint_load(cfg, groups, batch, full_sd, save_dir) -> dict:
    """Under another layout: the LoRA checkpoint resumes (resharded); mismatched resumes are one line each."""
    from megatron_rl.checkpoint import load_checkpoint

    adam = lora_config(*[getattr(cfg.parallel, f) for f in ("tensor_model_parallel_size",
                                                            "pipeline_model_parallel_size",
                                                            "context_parallel_size")], optimizer="adam")
    resumed = _policy(adam, groups, base_only(full_sd))
    load_checkpoint(resumed, f"{save_dir}/lora")
    out = {"ckpt_resumed_other_layout": _step(resumed, batch)}
    other_base = {k: v + 0.01 if k.endswith("linear_fc2.weight") else v for k, v in base_only(full_sd).items()}
    full_cfg = lora_config(1, 1, 2, rank=0, optimizer="adam")
    for case, policy_cfg, weights, path in [("full_into_lora", adam, full_sd, "full"),
                                            ("lora_into_full", full_cfg, base_only(full_sd), "lora"),
                                            ("other_base", adam, other_base, "lora")]:
        try:
            load_checkpoint(_policy(policy_cfg, groups, weights), f"{save_dir}/{path}")
            out[case] = "no error"
        except ValueError as err:
            out[case] = str(err)
    return out


def base_only(full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron_rl.model.lora import is_adapter_name

    return {k: v for k, v in full_sd.items() if not is_adapter_name(k)}


def _layouts_rank(rank, world_size, tensors, full_sd, save_dir):
    from megatron.core import parallel_state

    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    batch, out = training_batch(tensors), {}
    for name, (tp, pp, cp, sp, counts) in LAYOUTS.items():
        if parallel_state.model_parallel_is_initialized():
            destroy_distributed(keep_process_group=True)
        cfg = lora_config(tp, pp, cp, sequence_parallel=sp)
        groups = initialize_distributed(cfg.parallel, cfg.seed)
        policy = _policy(cfg, groups, full_sd)
        for count in counts:
            out[name, "loss", count], out[name, "grads", count] = _grads(policy, batch, groups.dp_size, count)
        out[name, "grad_norm"], out[name, "sgd"] = _step(policy, batch)
        if name == "dp2":  # the distributed optimizer over DP, adapters only
            dist_cfg = lora_config(tp, pp, cp, sequence_parallel=sp, optimizer="adam", distributed=True)
            _, out[name, "adam"] = _step(_policy(dist_cfg, groups, full_sd), batch)
        if name == "tp2":
            out.update(_checkpoint_save(groups, batch, full_sd, save_dir))
        if name == "cp2":
            out.update(_checkpoint_load(cfg, groups, batch, full_sd, save_dir))
    return out


@pytest.fixture(scope="module")
def layouts(reference, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("lora_ckpt"))
    return run_ranks(2, _layouts_rank, batch_tensors(), reference["full_sd"], save_dir, timeout=600)


@pytest.mark.multirank
def test_step_is_layout_invariant(layouts, reference):
    """Loss, adapter gradients (every micro-batch count), grad norm and one SGD / Adam step == one process."""
    assert reference["grad_norm"] > 0 and all(g.abs().max() > 0 for g in reference["grads"].values())
    for rank_out in layouts:
        for name, (_, _, _, sp, counts) in LAYOUTS.items():
            for count in counts:
                assert rank_out[name, "loss", count] == pytest.approx(reference["loss"], rel=TOLERANCE)
                err = max_rel_err(rank_out[name, "grads", count], reference["grads"])
                assert err < TOLERANCE, f"{name}, {count} micro-batches: adapter gradient relative error {err:.2e}"
            assert rank_out[name, "grad_norm"] == pytest.approx(reference["grad_norm"], rel=TOLERANCE), name
            assert max_rel_err(rank_out[name, "sgd"], reference["sgd"]) < 1e-6, name
            if name == "dp2":
                assert max_rel_err(rank_out[name, "adam"], reference["adam"]) < 1e-6, name


@pytest.mark.multirank
def test_checkpoint_resumes_adapters_and_refuses_mismatches(layouts):
    """A LoRA checkpoint (adapters + Adam state + run state, no base) resumes bitwise in place and under another
    layout (TP2 -> CP2); full <-> LoRA and another base are one-line errors."""
    for rank_out in layouts:
        assert rank_out["ckpt_state"] == {"step": 1}
        norm, weights = rank_out["ckpt_next"]
        assert rank_out["ckpt_resumed_same_layout"][0] == norm
        assert all(torch.equal(weights[k], v) for k, v in rank_out["ckpt_resumed_same_layout"][1].items())
        assert max_rel_err(rank_out["ckpt_resumed_other_layout"][1], weights) < 1e-6
        assert rank_out["ckpt_resumed_other_layout"][0] == pytest.approx(norm, rel=TOLERANCE)
        assert "holds a full fine-tune (model.lora.rank=0) but this run is LoRA" in rank_out["full_into_lora"]
        assert "holds LoRA adapters (model.lora.rank=8) but this run is a full fine-tune" in rank_out["lora_into_full"]
        assert "trained on another base model" in rank_out["other_base"]
        assert all("\n" not in rank_out[k] for k in ("full_into_lora", "lora_into_full", "other_base"))
