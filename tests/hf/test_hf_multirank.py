"""HF checkpoints in and out of MegatronPolicy under DP2 (TP1), TP2 and PP2, against the HF model itself.

One 2-rank spawn visits the three layouts (re-initializing megatron's parallel state in between) and, for each
tiny model variant of ``conftest.py`` (Llama; Qwen2 with q/k/v biases; Qwen3 with q/k norms and
head_dim != hidden/heads; Qwen2 with tied embeddings; Llama with vocab 255, padded to 256 under TP2):
- imports the HF safetensors, runs ``MegatronPolicy.forward`` (packed THD input) on a left-padded batch;
- on PP1 layouts also runs the bare GPTModel on the padded batch with an explicit causal+padding mask
  (the unpacked path), gathering the vocab-parallel logits;
- exports back to HF format.
The parent compares per-token response log-probs with ``transformers``' own forward on the same left-padded
batch (fp32: max |diff| < 1e-4), the exported safetensors with the source (bitwise), and reloads the export
with ``transformers``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.support.batches import left_padded_tensors
from tests.support.exports import assert_same_weights
from tests.support.multirank import run_ranks

PROMPT_LENS = [5, 2, 9, 3]
RESPONSE_LENS = [4, 7, 1, 6]
LAYOUTS = {"tp1dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
TOL = 1e-4  # fp32, same weights: only summation-order differences (measured <= 1e-6)


def _batch_tensors(vocab: int = 255, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded sequences [B, S] / right-aligned response mask [B, R] (docs/DESIGN.md section 2)."""
    return left_padded_tensors(PROMPT_LENS, RESPONSE_LENS, vocab, torch.Generator().manual_seed(seed), low=3)


def response_logprobs_from_logits(logits: torch.Tensor, sequences: torch.Tensor, width: int) -> torch.Tensor:
    """Full-vocab logits [B, S, V] -> log p(sequences[:, t+1]) for the last ``width`` targets: [B, width]."""
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    token = logp.gather(-1, sequences[:, 1:, None]).squeeze(-1)  # [B, S-1]
    return token[:, -width:]


@functools.lru_cache(maxsize=None)
def _hf_reference(hf_dir: str) -> torch.Tensor:
    """HF log-probs of the test batch, computed once per model directory."""
    return hf_response_logprobs(Path(hf_dir), _batch_tensors())


def hf_response_logprobs(hf_dir: Path, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=tensors["sequences"], attention_mask=tensors["attention_mask"]).logits
    return response_logprobs_from_logits(logits, tensors["sequences"], tensors["response_mask"].shape[1])


# ---------------------------------------------------------------------- runs in the children


def _padded_forward_logprobs(module, tensors: dict[str, torch.Tensor], groups, vocab: int) -> torch.Tensor:
    """The unpacked path: bare GPTModel on [B, S] with a causal + left-padding mask (True = masked); the
    columns of TP vocabulary padding (beyond ``vocab``) are dropped."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq, am = tensors["sequences"], tensors["attention_mask"].bool()
    s = seq.shape[1]
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool))[None] & am[:, None, :]
    positions = torch.arange(s)[None].expand_as(seq)
    with torch.no_grad():
        logits = module(seq, positions, ~allowed[:, None])  # [B, S, V/tp]
        logits = gather_from_tensor_model_parallel_region(logits, group=groups.tp_group)[..., :vocab]
    return response_logprobs_from_logits(logits, seq, tensors["response_mask"].shape[1])


def _layout_run(layout: str, model_dirs: dict[str, str], tensors, export_root: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.config import MegatronRLConfig, ModelConfig, ParallelConfig
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.weights import export_policy_to_hf, policy_from_hf

    tp, pp = LAYOUTS[layout]
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    groups = initialize_distributed(parallel, seed=7)
    n = tensors["sequences"].shape[0]
    batch = TrainingBatch(dict(tensors), list(range(n)), list(range(n)), [True] * n)
    out = {}
    for variant, path in model_dirs.items():
        config = MegatronRLConfig(parallel=parallel, model=ModelConfig(attention_backend="local"))
        policy = policy_from_hf(config, groups, role="reference", hf_dir=path)
        out[(variant, "packed")] = policy.forward(batch)["logprobs"]
        if pp == 1:
            vocab = policy.config.model.vocab_size
            out[(variant, "padded")] = _padded_forward_logprobs(policy.module, tensors, groups, vocab)
        export_policy_to_hf(policy, Path(export_root) / f"{layout}_{variant}")
    parallel_state.destroy_model_parallel()
    return out


def _hf_child(rank: int, world_size: int, model_dirs: dict[str, str], tensors, export_root: str) -> dict:
    results = {}
    for layout in LAYOUTS:
        for key, value in _layout_run(layout, model_dirs, tensors, export_root).items():
            results[(layout, *key)] = value
    return results if rank == 0 else {}


# ---------------------------------------------------------------------- tests (parent)


@pytest.fixture(scope="module")
def hf_run(hf_models, tmp_path_factory):
    export_root = tmp_path_factory.mktemp("hf_export")
    tensors = _batch_tensors()
    dirs = {name: str(path) for name, path in hf_models.items()}
    results = run_ranks(2, _hf_child, dirs, tensors, str(export_root), timeout=300)[0]
    return results, tensors, export_root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_hf(hf_run, hf_models, layout):
    results, tensors, _ = hf_run
    mask = tensors["response_mask"].bool()
    for variant, path in hf_models.items():
        reference = _hf_reference(str(path))
        paths = ["packed"] + (["padded"] if LAYOUTS[layout][1] == 1 else [])
        for path_kind in paths:
            ours = results[(layout, variant, path_kind)]
            diff = (ours - reference)[mask].abs().max().item()
            assert diff < TOL, (layout, variant, path_kind, diff)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_is_bitwise_and_loads_in_transformers(hf_run, hf_models, layout):
    _, tensors, export_root = hf_run
    for variant, src in hf_models.items():
        out = export_root / f"{layout}_{variant}"
        assert_same_weights(src, out, (layout, variant))
        assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
        assert torch.equal(hf_response_logprobs(out, tensors), _hf_reference(str(src)))


def _gpu_child(rank: int, world_size: int, hf_dirs: dict[str, str], tensors) -> dict[str, torch.Tensor]:
    """Every variant in one CUDA process (one spawn and one CUDA start-up instead of one per variant)."""
    from megatron_rl.config import MegatronRLConfig, ModelConfig, ParallelConfig
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.weights import policy_from_hf

    groups = initialize_distributed(ParallelConfig(device="cuda"), seed=7)
    config = MegatronRLConfig(model=ModelConfig(params_dtype="bfloat16", attention_backend="auto"))
    n = tensors["sequences"].shape[0]
    batch = TrainingBatch(dict(tensors), list(range(n)), list(range(n)), [True] * n)  # host: the policy moves it
    out = {}
    for variant, hf_dir in hf_dirs.items():
        logprobs = policy_from_hf(config, groups, role="reference", hf_dir=hf_dir).forward(batch)["logprobs"]
        assert logprobs.device.type == "cpu", logprobs.device  # results come back on the host
        out[variant] = logprobs.float()
    return out


@pytest.mark.gpu
def test_logprobs_match_hf_bf16_gpu(hf_models):
    """bf16 weights and activations (TE attention when installed) vs the fp32 HF forward of the same weights.

    Tolerance: bf16 keeps 8 significant bits (relative rounding 2**-9 per operation). The tiny models' logits
    are O(1), so each layer adds errors of order 1e-3 to 1e-2 in the logits; log-softmax in fp32 passes them
    through roughly unchanged. Two layers plus embedding/output rounding stay well inside max |diff| 0.05 and a
    mean of 0.01, while a wrong mapping moves log-probs by 0.06-0.4 (negative controls of docs/HF.md section 4).
    """
    tensors = _batch_tensors()
    mask = tensors["response_mask"].bool()
    dirs = {variant: str(path) for variant, path in hf_models.items()}
    ours = run_ranks(1, _gpu_child, dirs, tensors, timeout=300, cpu_only=False)[0]
    for variant, path in dirs.items():
        diff = (ours[variant] - _hf_reference(path))[mask].abs()
        assert diff.max().item() < 0.05 and diff.mean().item() < 0.01, (variant, diff.max().item())
