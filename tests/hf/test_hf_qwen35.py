"""Qwen3.5 checkpoints in and out (hf/qwen35.py): ``policy_from_hf`` reads the text-only and the multimodal layout,
its log-probs equal transformers' (one sequence per forward), the built-in engine samples from it with
transformers' log-probs, export and the vLLM weight sync's stream (``iter_stage_hf_weights``) give every tensor
back bitwise and transformers loads the export with the source's logits.

Tolerance 1e-5 on log-probs: fp32, the same formulas in another order (tests/model/test_hybrid.py).
"""

import pytest
import torch

from tests.support.batches import left_padded_tensors, training_batch
from megatron_rl.config import MegatronRLConfig, ModelConfig, ParallelConfig
from megatron_rl.distributed.bootstrap import initialize_distributed
from megatron_rl.model import hybrid

pytestmark = pytest.mark.skipif(
    not hybrid.mcore_supports_hybrid(),
    reason=f"hybrid Gated-DeltaNet models need megatron-core>={hybrid.MIN_MCORE} (docs/MEGATRON_CORE.md)")


GROUPS_SEED = 5  # the ``groups`` fixture's (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.support.qwen35_tiny import save_checkpoint

    root = tmp_path_factory.mktemp("qwen35_ckpts")
    return {"text": save_checkpoint(root / "text"), "multimodal": save_checkpoint(root / "vl", multimodal=True)}


def _hf_row_logprobs(hf, tensors) -> torch.Tensor:
    """[B, R] log-probs from transformers, one unpadded sequence per forward, right-aligned as the policy's."""
    seqs, am = tensors["sequences"], tensors["attention_mask"]
    width, resp = seqs.shape[1], tensors["response_mask"].shape[1]
    rows = []
    for i in range(seqs.shape[0]):
        tokens = seqs[i][am[i].bool()]
        with torch.no_grad():
            lp = torch.log_softmax(hf(tokens[None]).logits[0].float(), -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
        full = torch.cat([torch.zeros(width - len(tokens)), lp, torch.zeros(1)])  # column c predicts c+1
        rows.append(full[width - resp - 1: width - 1])
    return torch.stack(rows)


def _check_builtin_engine(policy, hf) -> None:
    """The built-in engine samples from the policy: each recorded log-prob is transformers' log-prob of the
    sampled token given the prompt and the tokens before it."""
    from megatron_rl.inference.builtin_engine import BuiltinEngine
    from megatron_rl.inference.engine import SamplingSpec

    prompts = [[5, 9, 17, 33], [40, 41]]
    engine = BuiltinEngine.from_policy(policy, pad_token_id=0)
    for prompt, completion in zip(prompts, engine.generate(prompts, SamplingSpec(max_tokens=6), seed=1)):
        ids = torch.tensor(prompt + completion.token_ids)
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
        want = logprobs[len(prompt) - 1: -1].gather(-1, ids[len(prompt):, None])[:, 0]
        assert len(completion.token_ids) == 6
        assert (torch.tensor(completion.logprobs) - want).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["text", "multimodal"])
def test_policy_from_hf_matches_transformers_and_export_round_trips(layout, groups, checkpoints, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    from megatron_rl.hf import export_policy_to_hf, policy_from_hf

    source = checkpoints[layout]
    config = MegatronRLConfig(model=ModelConfig(attention_backend="local"))
    policy = policy_from_hf(config, groups, role="reference", hf_dir=source)
    assert policy.config.model.linear_attention_freq == [1, 0, 1, 0]
    assert policy.config.model.family == {"text": "qwen35", "multimodal": "qwen35_vl"}[layout]

    tensors = left_padded_tensors([5, 30, 2], [9, 40, 3], 256, torch.Generator().manual_seed(0), low=3)
    got = policy.forward(training_batch(tensors))["logprobs"]
    hf_text = AutoModelForCausalLM.from_pretrained(checkpoints["text"], dtype=torch.float32).eval()
    want = _hf_row_logprobs(hf_text, tensors)
    mask = tensors["response_mask"].bool()
    assert (got - want)[mask].abs().max() < 1e-5

    if layout == "text":
        _check_builtin_engine(policy, hf_text)
    original = load_file(f"{source}/model.safetensors")
    from megatron_rl.hf.weights import iter_stage_hf_weights  # the vLLM weight sync's stream: the model, bitwise

    streamed = dict(iter_stage_hf_weights([policy.module], source, groups))
    assert streamed.keys() == original.keys()  # the multimodal layout: its vision tower too (hf/families/qwen35_vl.py)
    assert all(torch.equal(tensor, original[k]) for k, tensor in streamed.items())
    out = export_policy_to_hf(policy, tmp_path / "export", source)
    exported = load_file(f"{out}/model.safetensors")
    assert exported.keys() == original.keys()  # the multimodal vision tower is the model's (untrained here)
    assert all(torch.equal(exported[k], original[k]) for k in original), "round trip is not bitwise"
    if layout == "multimodal":
        _, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        return
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tensors["sequences"][1][tensors["attention_mask"][1].bool()][None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_text(ids).logits)


# ---------------------------------------------------------------------- GPU (skipped without CUDA)


def _cuda_child(rank: int, world_size: int, hf_dir: str, tensors, device: str = "cuda") -> dict:
    """The tiny Qwen3.5 on CUDA, fp32 (TF32 off) and bf16: log-probs, then one SGD step (finite grad norm).
    Gated-DeltaNet runs fla's Triton kernels where fla is importable, else the torch stand-ins of P12."""
    import importlib.util

    from megatron_rl.config import OptimizerConfig
    from megatron_rl.hf import policy_from_hf
    from tests.support.batches import summed_pg_loss

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # no-ops on a CPU
    groups = initialize_distributed(ParallelConfig(device=device), seed=5)
    out = {"fla": importlib.util.find_spec("fla") is not None}
    batch = training_batch(tensors)
    for dtype in ("float32", "bfloat16"):
        config = MegatronRLConfig(model=ModelConfig(attention_backend="local", params_dtype=dtype),
                                  optimizer=OptimizerConfig(optimizer="sgd", lr=1e-3))
        policy = policy_from_hf(config, groups, hf_dir=hf_dir)
        assert next(policy.module.parameters()).device.type == device
        out[dtype] = policy.forward(batch)["logprobs"].float()
        policy.forward_backward(batch, summed_pg_loss, None)
        out[f"grad_norm_{dtype}"] = policy.optim_step()["grad_norm"]
    return out


@pytest.mark.gpu
def test_qwen35_on_cuda_matches_transformers(checkpoints):
    """Qwen3.5 (Gated-DeltaNet + gated attention) on a GPU against transformers' fp32 forward on the host.

    Tolerances: bf16 as ``test_logprobs_match_hf_bf16_gpu`` (8 significant bits per operation, O(1) logits:
    max 0.05, mean 0.01; a wrong mapping moves log-probs by more than 0.06). fp32 with TF32 off: the CPU test's
    1e-5 becomes 1e-4 for the different kernels (cuBLAS, and fla's chunked Triton recurrence where installed);
    fla's kernels in fp32 may round their dots like TF32 (10 bits), hence 5e-3 there.
    """
    from tests.support.multirank import run_ranks

    tensors = left_padded_tensors([5, 30, 2], [9, 40, 3], 256, torch.Generator().manual_seed(0), low=3,
                                  advantages=True)
    got = run_ranks(1, _cuda_child, str(checkpoints["text"]), tensors, timeout=300, cpu_only=False)[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["text"], dtype=torch.float32).eval()
    want = _hf_row_logprobs(hf, tensors)
    mask = tensors["response_mask"].bool()
    fp32 = (got["float32"] - want)[mask].abs()
    bf16 = (got["bfloat16"] - want)[mask].abs()
    print(f"qwen35 cuda fla={got['fla']}: fp32 max {fp32.max():.2e}; bf16 max {bf16.max():.2e} mean "
          f"{bf16.mean():.2e}; grad norms {got['grad_norm_float32']:.4f} {got['grad_norm_bfloat16']:.4f}")
    assert fp32.max() < (5e-3 if got["fla"] else 1e-4)
    assert bf16.max() < 0.05 and bf16.mean() < 0.01
    for dtype in ("float32", "bfloat16"):
        assert torch.isfinite(torch.tensor(got[f"grad_norm_{dtype}"])) and got[f"grad_norm_{dtype}"] > 0
