"""Hybrid Gated-DeltaNet models (Qwen3.5, model/hybrid.py): the packed Megatron forward equals transformers per
sequence, and no state crosses a packed-sequence boundary.

Reference: transformers' ``Qwen3_5ForCausalLM`` (its pure-torch GDN fallbacks), ONE sequence per forward:
without fla it cannot keep packed sequences apart (docs/QWEN35.md). Tolerance 1e-5 on fp32 logits: the same
formulas evaluated in a different order (measured ~2e-7); a state leak moves later sequences by ~1e-1.
"""

import dataclasses

import pytest
import torch

from megatron_rl.config import ParallelConfig
from megatron_rl.data.packing import pack
from megatron_rl.model import hybrid

needs_hybrid = pytest.mark.skipif(
    not hybrid.mcore_supports_hybrid(),
    reason=f"hybrid Gated-DeltaNet models need megatron-core>={hybrid.MIN_MCORE} (docs/MEGATRON_CORE.md)")

LENGTHS = [37, 5, 70, 21]  # 70 spans two 64-token chunks of the delta rule
ALIGN = 8  # trailing pad tokens inside the pack: the padding rule of model/hybrid.py


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    from tests.support.qwen35_tiny import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("qwen35") / "text")


def _sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _left_padded(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


def megatron_from_hf(hf_dir, groups, parallel=None):
    """(ModelConfig, GPTModel in eval mode) with the checkpoint's weights through hf/qwen35.py's mapping."""
    from safetensors.torch import load_file

    from megatron_rl.hf import model_config_from_hf, qwen35
    from megatron_rl.model.builder import build_gpt_model
    from megatron_rl.model.weights import load_full_state_dict

    cfg = model_config_from_hf(hf_dir)
    model = build_gpt_model(cfg, parallel or ParallelConfig(), groups).eval()
    load_full_state_dict(model, qwen35.hf_to_megatron(load_file(f"{hf_dir}/model.safetensors"), cfg), groups)
    return cfg, model


def _packed_logits(model, packed, vocab):
    with torch.no_grad():
        logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.packed_seq_params())
    return logits[0, :, :vocab].float()  # [T, V]


def _max_diff_per_sequence(logits, packed, references):
    starts = packed.cu_seqlens[:-1].tolist()
    return [(logits[s:s + len(ref)] - ref).abs().max().item() for s, ref in zip(starts, references)]


@needs_hybrid
def test_packed_forward_matches_hf_per_sequence_and_a_state_leak_is_caught(groups, qwen35_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    cfg, model = megatron_from_hf(qwen35_dir, groups)
    assert cfg.linear_attention_freq == [1, 0, 1, 0] and cfg.rotary_percent == 0.25
    hf = AutoModelForCausalLM.from_pretrained(qwen35_dir, dtype=torch.float32).eval()
    seqs = _sequences(cfg.vocab_size)
    with torch.no_grad():
        references = [hf(s[None]).logits[0].float() for s in seqs]
    packed = pack(*_left_padded(seqs), align=ALIGN)
    assert packed.total_len > sum(LENGTHS)  # the pack carries trailing pad tokens
    diffs = _max_diff_per_sequence(_packed_logits(model, packed, cfg.vocab_size), packed, references)
    assert max(diffs) < 1e-5, diffs

    if torch.cuda.is_available():  # the planted leak below replaces P12's loop (CPU only)
        return
    from megatron_rl.patches import fla_standins

    monkeypatch.setattr(fla_standins, "_segments", lambda length, cu_seqlens: [(0, length)])  # one state for all
    leaked = _max_diff_per_sequence(_packed_logits(model, packed, cfg.vocab_size), packed, references)
    assert leaked[0] < 1e-5 and min(leaked[1:]) > 1e-3, leaked


@needs_hybrid
def test_unpacked_input_is_refused(groups, qwen35_dir):
    cfg, model = megatron_from_hf(qwen35_dir, groups)
    ids = torch.randint(3, cfg.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="Gated-DeltaNet layer got unpacked input"):
        model(ids, torch.arange(8)[None], None)


def test_hybrid_config_errors(monkeypatch):
    """Runs on both ends: the installed megatron-core version is replaced by each end's."""
    from megatron_rl.config import ConfigError, ModelConfig
    from megatron_rl.model.builder import build_transformer_config

    base = ModelConfig(num_layers=2, linear_attention_freq=[1, 0])
    with pytest.raises(ConfigError, match=r"linear_attention_freq=\[1, 2\] must list 0 .* model.num_layers=2"):
        dataclasses.replace(base, linear_attention_freq=[1, 2])
    monkeypatch.setattr(hybrid.importlib.metadata, "version", lambda name: "0.16.1")
    with pytest.raises(ValueError, match=r"^model.linear_attention_freq .* needs megatron-core>=0.18.0 \(packed GDN "
                                         r"input\); 0.16.1 is installed: use the megatron-core 0.19.2 environment"):
        build_transformer_config(base, ParallelConfig())
    monkeypatch.setattr(hybrid.importlib.metadata, "version", lambda name: "0.19.2")
    with pytest.raises(ValueError, match="context_parallel_size=2 with model.linear_attention_freq"):
        build_transformer_config(base, ParallelConfig(context_parallel_size=2))
    with pytest.raises(ValueError, match="linear_num_key_heads=2 is not divisible by tensor_model_parallel_size=8"):
        build_transformer_config(dataclasses.replace(base, num_attention_heads=8, num_query_groups=8),
                                 ParallelConfig(tensor_model_parallel_size=8))
    with pytest.raises(ValueError, match="num_moe_experts with model.linear_attention_freq"):
        build_transformer_config(dataclasses.replace(base, num_moe_experts=2), ParallelConfig())


def test_vllm_engine_dtype_and_shapes_at_start_up(tmp_path):
    """On CPU vLLM serves a Qwen3.5 in bf16 only, with a GDN head dim of 64 or 128: 'auto' picks bf16, the rest
    is refused in one line naming the field, before any engine starts (config validation)."""
    import json

    from megatron_rl.config import ConfigError, ModelConfig
    from megatron_rl.hf.config import model_config_from_hf
    from megatron_rl.inference.config import RolloutConfig, agreement_bound, engine_dtype
    from megatron_rl.inference.registry import check_engine_config

    def hf(dim: int):
        path = tmp_path / f"hd{dim}"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "hidden_size": 64, "head_dim": 32,
                                                      "num_attention_heads": 4, "linear_key_head_dim": dim,
                                                      "linear_value_head_dim": 128}))
        return model_config_from_hf(path, key="model.hf_path")  # as the job resolves it (load_job_config)

    vllm = RolloutConfig(engine="vllm")
    local = ModelConfig(num_layers=2, linear_attention_freq=[1, 0], kv_channels=32, linear_key_head_dim=64,
                        linear_value_head_dim=64)
    for model in (local, hf(64)):
        check_engine_config(vllm, model, "cpu")
        assert engine_dtype(vllm, model, "cpu")[0] == engine_dtype(vllm, model, "auto")[0] == "bfloat16"
        assert engine_dtype(vllm, model, "cuda")[0] == "float32"  # GPUs: the policy's dtype
        with pytest.raises(ConfigError, match="rollout.dtype=float32 with a hybrid .* set rollout.dtype=auto"):
            check_engine_config(RolloutConfig(engine="vllm", dtype="float32"), model, "cpu")
    with pytest.raises(ConfigError, match=r"Gated-DeltaNet head dim in \(64, 128\).* has linear_key_head_dim=32;"):
        check_engine_config(vllm, hf(32), "cpu")
    with pytest.raises(ConfigError, match=r"but model.linear_value_head_dim=32;"):
        check_engine_config(vllm, dataclasses.replace(local, linear_value_head_dim=32), "cpu")
    check_engine_config(RolloutConfig(engine="builtin"), hf(32), "cpu")
    assert engine_dtype(vllm, ModelConfig(), "cpu")[0] == "float32"  # not hybrid: the policy's dtype
    assert agreement_bound("bfloat16", "float32") == 2.0**-5 and agreement_bound("float32", "float32") == 1e-4


@needs_hybrid
def test_checkpoint_round_trip(groups, qwen35_dir, tmp_path):
    """megatron's sharded state of the GDN layers (in_proj split per block) saves and loads bitwise."""
    from megatron_rl.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_rl.config import MegatronRLConfig, ModelConfig
    from megatron_rl.hf import policy_from_hf
    from megatron_rl.model.policy import MegatronPolicy

    policy = policy_from_hf(MegatronRLConfig(model=ModelConfig(attention_backend="local")), groups, hf_dir=qwen35_dir)
    save_checkpoint(policy, tmp_path, {"step": 1})
    fresh = MegatronPolicy(policy.config, groups)  # random weights
    assert load_checkpoint(fresh, tmp_path)["step"] == 1
    saved, loaded = policy.full_state_dict(), fresh.full_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
