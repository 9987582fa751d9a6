"""LoRA against Hugging Face: the trainer with random adapters == transformers with the same adapters applied by
hand on its q/k/v/o/gate/up/down projections (plain torch: ``x + scale * B @ A x``, peft's forward).

The reference never sees megatron's fused layouts (QKV per query group, fc1 [gate; up]): it checks that the
adapter forward places each HF module's update where HF has it, and that ``lora.peft_name`` maps each adapter to
its HF module. Qwen3: GQA, q/k norms after the projections, head_dim != hidden / heads. One process, in-process.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.batches import left_padded_tensors, training_batch
from tests.support.lora_helpers import randomize_adapters
from megatron_rl.config import LoraConfig, MegatronRLConfig, ModelConfig, ParallelConfig
from megatron_rl.distributed.bootstrap import initialize_distributed

RANK, ALPHA = 8, 16.0


def _hf_row_logprobs(model, tensors, adapters: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """[B, R] log-probs of transformers' model with the adapters hooked onto its projections, one row at a time."""
    handles = []
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in adapters:
            a, b = adapters[key], adapters[key.replace("lora_A", "lora_B")]
            hook = lambda mod, args, out, a=a, b=b: out + scale * (args[0] @ a.t()) @ b.t()  # noqa: E731
            handles.append(module.register_forward_hook(hook))
    assert len(handles) == len(adapters) // 2, "every adapter must find its HF module"
    seqs, am, width = tensors["sequences"], tensors["attention_mask"], tensors["sequences"].shape[1]
    resp = tensors["response_mask"].shape[1]
    rows = []
    with torch.no_grad():
        for i in range(len(seqs)):
            tokens = seqs[i][am[i].bool()][None]  # [1, n]
            lp = torch.log_softmax(model(tokens).logits[0, :-1].float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
            full = torch.cat([torch.zeros(width - tokens.shape[1]), lp, torch.zeros(1)])  # column c predicts c+1
            rows.append(full[width - resp - 1: width - 1])
    for handle in handles:
        handle.remove()
    return torch.stack(rows)


@pytest.mark.parametrize("targets", [None, ["v_proj", "up_proj", "o_proj"]], ids=["all", "some"])
def test_trainer_adapters_match_transformers_and_export_to_peft(groups, hf_models, tmp_path, targets):
    """All seven modules; some of them (the fused QKV and gate/up then carry zero updates for the others)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.hf.weights import policy_from_hf
    from megatron_rl.model.lora import is_adapter_name, peft_name

    lora = LoraConfig(rank=RANK, alpha=ALPHA, **({"target_modules": targets} if targets else {}))
    config = MegatronRLConfig(model=ModelConfig(attention_backend="local", lora=lora))
    policy = policy_from_hf(config, groups, hf_dir=hf_models["qwen3"])
    tensors = left_padded_tensors([4, 7, 2], [5, 3, 6], 256, torch.Generator().manual_seed(0))
    batch = training_batch(tensors)
    hf = AutoModelForCausalLM.from_pretrained(hf_models["qwen3"], dtype=torch.float32).eval()
    base = policy.forward(batch)["logprobs"]
    mask = tensors["response_mask"].bool()
    assert (base - _hf_row_logprobs(hf, tensors, {}, 0.0))[mask].abs().max() < 1e-5  # step 0: B = 0

    randomize_adapters(policy.module, seed=1, rank=RANK)
    adapters = {peft_name(k): v for k, v in policy.full_state_dict().items() if is_adapter_name(k)}
    assert len(adapters) == 2 * len(lora.target_modules) * 2  # A and B of each module in 2 layers
    got = policy.forward(batch)["logprobs"]
    want = _hf_row_logprobs(hf, tensors, adapters, ALPHA / RANK)
    assert (got - base)[mask].abs().max() > 0.05, "the random adapters must change the log-probs"
    assert (got - want)[mask].abs().max() < 1e-5

    # Export: the merged model loads in transformers, the adapter beside it in peft; both match the trainer.
    from megatron_rl.hf.weights import export_policy_to_hf

    out = export_policy_to_hf(policy, tmp_path / "export")
    assert not (out / "adapter_config.json").exists()  # transformers would take the export for an adapter
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (got - _hf_row_logprobs(merged, tensors, {}, 0.0))[mask].abs().max() < 1e-5
    peft = pytest.importorskip("peft")
    peft_model = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    assert (got - _hf_row_logprobs(peft_model, tensors, {}, 0.0))[mask].abs().max() < 1e-5


# ---------------------------------------------------------------------- GPU (skipped without CUDA)


def _cuda_child(rank: int, world_size: int, hf_dir: str, tensors, device: str = "cuda") -> dict:
    """LoRA on CUDA in bf16: random adapters, log-probs, then one Adam step that must move the adapters only."""
    from tests.support.batches import summed_pg_loss
    from megatron_rl.config import OptimizerConfig
    from megatron_rl.hf.weights import policy_from_hf
    from megatron_rl.model.lora import is_adapter_name, peft_name

    groups = initialize_distributed(ParallelConfig(device=device), seed=3)
    config = MegatronRLConfig(model=ModelConfig(attention_backend="local", params_dtype="bfloat16",
                                                lora=LoraConfig(rank=RANK, alpha=ALPHA)),
                              optimizer=OptimizerConfig(lr=1e-3))
    policy = policy_from_hf(config, groups, hf_dir=hf_dir)
    assert next(policy.module.parameters()).device.type == device
    randomize_adapters(policy.module, seed=1, rank=RANK)
    before = {k: v.float() for k, v in policy.full_state_dict().items()}
    batch = training_batch(tensors)
    logprobs = policy.forward(batch)["logprobs"].float()
    policy.forward_backward(batch, summed_pg_loss, None)
    grad_norm = policy.optim_step()["grad_norm"]
    after = {k: v.float() for k, v in policy.full_state_dict().items()}
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    return {"logprobs": logprobs, "grad_norm": grad_norm, "moved": moved,
            "adapters": {peft_name(k): v for k, v in before.items() if is_adapter_name(k)},
            "adapter_names": {k for k in before if is_adapter_name(k)}}


@pytest.mark.gpu
def test_lora_on_cuda_matches_transformers_and_trains_adapters_only(hf_models):
    """bf16 on a GPU against transformers' fp32 forward with the same adapters (tolerance of
    ``test_logprobs_match_hf_bf16_gpu``: max 0.05, mean 0.01), and one step changes every adapter and no base
    weight."""
    from transformers import AutoModelForCausalLM

    from tests.support.multirank import run_ranks

    tensors = left_padded_tensors([4, 7, 2], [5, 3, 6], 256, torch.Generator().manual_seed(0), advantages=True)
    got = run_ranks(1, _cuda_child, str(hf_models["qwen3"]), tensors, timeout=300, cpu_only=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(hf_models["qwen3"], dtype=torch.float32).eval()
    want = _hf_row_logprobs(hf, tensors, got["adapters"], ALPHA / RANK)
    diff = (got["logprobs"] - want)[tensors["response_mask"].bool()].abs()
    print(f"lora cuda bf16: max {diff.max():.2e} mean {diff.mean():.2e} grad norm {got['grad_norm']:.4f}")
    assert diff.max() < 0.05 and diff.mean() < 0.01
    assert got["moved"] == got["adapter_names"], "one step must move every adapter and nothing else"
