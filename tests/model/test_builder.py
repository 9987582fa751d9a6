"""build_gpt_model: packed THD forward == padded forward == megatron's stock local spec, TP2 (+SP) == TP1.

References: megatron-core's own local layer spec (DotProductAttention + torch RMSNorm) with the same weights
for the padded path; full-vocab ``log_softmax`` for log-probs; the single-process model (its full state dict
sharded into each TP layout) for TP2.
"""

import dataclasses

import pytest
import torch

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.data.packing import pack
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.model.builder import build_gpt_model, build_transformer_config, padded_vocab_size
from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
from megatron_rl.model.weights import full_state_dict, load_full_state_dict
from tests.support.multirank import run_ranks

MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128, qk_layernorm=True, add_qkv_bias=True, attention_backend="local")
TIED = dataclasses.replace(MODEL, share_embeddings_and_output_weights=True, qk_layernorm=False,
                           add_qkv_bias=False)
LENGTHS = [7, 1, 12, 3]  # one row of length 1, one with 11 pad columns


def _batch(lengths=LENGTHS, width=12, seed=0):
    """Left-padded input_ids / attention_mask [b, width] with random pad tokens under the mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL.vocab_size, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    return ids, mask


def _padded_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron's [b, 1, S, S] bool mask (True = masked): causal and key padding combined."""
    width = attention_mask.shape[1]
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None]


def _device(model):
    """Where the model lives (groups.device: CUDA on a GPU machine); inputs go there, results come back."""
    return next(model.parameters()).device


def _padded_logits(model, ids, mask):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    inputs = [x.to(_device(model)) for x in (ids, positions, _padded_mask(mask))]
    with torch.no_grad():
        return model(*inputs).float().cpu()  # [b, S, V]


def _packed_logits(model, packed):
    packed = packed.to(_device(model))
    with torch.no_grad():
        return model(packed.input_ids, packed.position_ids, None,
                     packed_seq_params=packed.packed_seq_params()).float().cpu()  # [1, T, V]


def _packed_to_padded_index(packed, width):
    """(packed positions, row, padded column) of every valid token."""
    starts = packed.cu_seqlens[:-1].tolist()
    triples = [(s + j, i, width - n + j) for i, (s, n) in enumerate(zip(starts, packed.seq_lens.tolist()))
               for j in range(n)]
    return [torch.tensor(t) for t in zip(*triples)]


GROUPS_SEED = 11  # the ``groups`` fixture's (tests/conftest.py)


def _stock_model(model_cfg, groups, weights):
    """The same model on megatron's unmodified local spec (reference for our attention and norm)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = build_transformer_config(model_cfg, ParallelConfig())
    spec = get_gpt_layer_local_spec(qk_layernorm=model_cfg.qk_layernorm, normalization="RMSNorm")
    stock = GPTModel(config, spec, vocab_size=model_cfg.vocab_size, max_sequence_length=512,
                     share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
                     position_embedding_type="rope", pg_collection=groups.pg_collection)
    stock.load_state_dict(weights, strict=True)
    return stock.to(groups.device).eval()


@pytest.mark.parametrize("model_cfg", [MODEL, TIED], ids=["untied_qkln_qkvbias", "tied"])
def test_packed_equals_padded_equals_stock_megatron(groups, model_cfg):
    model = build_gpt_model(model_cfg, ParallelConfig(), groups).eval()
    ids, mask = _batch()
    padded = _padded_logits(model, ids, mask)
    stock = _padded_logits(_stock_model(model_cfg, groups, model.state_dict()), ids, mask)
    valid = mask.bool()
    assert (padded[valid] - stock[valid]).abs().max() < 1e-5

    packed = pack(ids, mask, align=1)
    logits = _packed_logits(model, packed)[0]  # [T, V]
    pos, row, col = _packed_to_padded_index(packed, ids.shape[1])
    ref_log_p = torch.log_softmax(padded[row, col], dim=-1)
    assert (torch.log_softmax(logits[pos], dim=-1) - ref_log_p).abs().max() < 1e-5

    logprobs, entropy = vocab_parallel_logprobs_entropy(logits, packed.labels[0], groups.tp_group, True)
    has_label = packed.label_mask[0].bool()[pos]
    ref_lp = ref_log_p.gather(-1, packed.labels[0][pos].unsqueeze(-1)).squeeze(-1)
    assert (logprobs[pos][has_label] - ref_lp[has_label]).abs().max() < 1e-5
    ref_entropy = -(ref_log_p.exp() * ref_log_p).sum(-1)
    assert (entropy[pos] - ref_entropy).abs().max() < 1e-5

    packed = packed.to(groups.device)
    whole_pack = dataclasses.replace(packed.packed_seq_params(), max_seqlen_q=packed.total_len,
                                     max_seqlen_kv=packed.total_len)
    with pytest.raises(ValueError, match="max_seqlen_q=23 equals the whole packed length"):
        model(packed.input_ids, packed.position_ids, None, packed_seq_params=whole_pack)


def test_build_time_shape_errors():
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by tensor_model_parallel_size=4"):
        build_transformer_config(dataclasses.replace(MODEL, num_attention_heads=8), ParallelConfig(
            tensor_model_parallel_size=4))
    with pytest.raises(ValueError, match="num_layers=3 is not divisible by pipeline_model_parallel_size=2"):
        build_transformer_config(dataclasses.replace(MODEL, num_layers=3), ParallelConfig(
            pipeline_model_parallel_size=2))
    with pytest.raises(ValueError, match="attention_backend='te'"):
        build_gpt_model(dataclasses.replace(MODEL, attention_backend="te"), ParallelConfig(), None)
    assert [padded_vocab_size(v, 4) for v in (128, 129, 131)] == [128, 132, 132]


def _tp2_forward(rank, world_size, full_sd, packs):
    """Each layout loads the same full weights and returns its log-probs / entropy per pack."""
    out = {}
    for name, parallel in [("tp2", ParallelConfig(tensor_model_parallel_size=2)),
                           ("tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))]:
        groups = initialize_distributed(parallel, seed=5)
        model = build_gpt_model(MODEL, parallel, groups).eval()
        load_full_state_dict(model, full_sd, groups)
        roundtrip = full_state_dict(model, groups)
        packed = packs[name]
        logits = _packed_logits(model, packed)[0]  # [T, V/2]
        lp, ent = vocab_parallel_logprobs_entropy(logits, packed.labels[0], groups.tp_group, True)
        out[name] = {"lp": lp, "ent": ent, "vocab_shard": logits.shape[-1],
                     "roundtrip": max((roundtrip[k] - full_sd[k]).abs().max().item() for k in full_sd),
                     "same_keys": roundtrip.keys() == full_sd.keys()}
        destroy_distributed(keep_process_group=True)
    return out


@pytest.mark.multirank
def test_tp2_and_sequence_parallel_match_single_process(groups):
    model = build_gpt_model(MODEL, ParallelConfig(), groups).eval()
    full_sd = full_state_dict(model, groups)
    ids, mask = _batch(seed=1)
    packs = {"tp2": pack(ids, mask, align=1), "tp2_sp": pack(ids, mask, align=2)}
    out = run_ranks(2, _tp2_forward, full_sd, packs)
    for name, packed in packs.items():
        logits = _packed_logits(model, packed)[0]
        ref_lp, ref_ent = vocab_parallel_logprobs_entropy(logits, packed.labels[0], None, True)
        for rank_out in out:
            result = rank_out[name]
            assert result["vocab_shard"] == MODEL.vocab_size // 2
            assert result["same_keys"] and result["roundtrip"] == 0.0
            assert (result["lp"] - ref_lp).abs().max() < 1e-5, name
            assert (result["ent"] - ref_ent).abs().max() < 1e-5, name


def test_full_state_dict_with_padded_vocab_loads_into_tp1(groups):
    """A full dict gathered under TP2 for vocab 127 holds 128 vocab rows (the padding row): a TP1 model drops
    that row; any other size mismatch still raises."""
    model_cfg = dataclasses.replace(MODEL, vocab_size=127)
    model = build_gpt_model(model_cfg, ParallelConfig(), groups)
    reference = full_state_dict(model, groups)
    padded = {k: torch.cat([v, torch.zeros_like(v[:1])]) if v.shape[0] == 127 else v for k, v in reference.items()}
    target = build_gpt_model(dataclasses.replace(model_cfg), ParallelConfig(), groups)
    load_full_state_dict(target, padded, groups)
    assert all(torch.equal(full_state_dict(target, groups)[k], v) for k, v in reference.items())
    bad = dict(reference, **{"decoder.final_layernorm.weight": torch.zeros(65)})
    with pytest.raises(ValueError, match="final_layernorm"):
        load_full_state_dict(target, bad, groups)
