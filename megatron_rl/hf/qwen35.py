"""Qwen3.5 (hybrid Gated-DeltaNet) checkpoints <-> megatron_rl: config fields and the weight mapping.

Place in the data flow: set-up (the Qwen3.5 family, ``hf/families/qwen35.py``, takes the fields from here) and the
weight mapping between a transformers state dict and a full (TP1/PP1, ``model/weights.py``) megatron state dict.
mbridge 0.15.1 (the newest release) has no Qwen3.5 bridge, so the mapping is written here (docs/QWEN35.md).

Layouts read: ``Qwen3_5ForCausalLM`` (``model_type`` qwen3_5_text, ``model.layers.*``) and the published
multimodal ``Qwen3_5ForConditionalGeneration`` (``model_type`` qwen3_5, the text config nested under
``text_config``, ``model.language_model.layers.*``): its language model (the vision tower, ``model.visual.*``, is
``hf/families/qwen35_vl.py``'s: it trains beside this language model; anything else of the source, MTP layers,
is copied unchanged on export).
mbridge is not used: every rank reads the checkpoint and ``model/weights.py`` shards it (``load_weights``);
export gathers the full state dict (``iter_weights``).

Mapping (``L`` = ``model.layers.{i}``, megatron ``D`` = ``decoder.layers.{i}``):

    L.input_layernorm / post_attention_layernorm   D.input_layernorm / pre_mlp_layernorm (zero-centred: 1 + w,
                                                   model/hybrid.py: ZeroCenteredRMSNorm; copied as they are)
    L.mlp.gate_proj ; up_proj / down_proj          D.mlp.linear_fc1 = [gate; up] / linear_fc2
    Gated-DeltaNet layer (L.linear_attn):
      in_proj_qkv ; in_proj_z ; in_proj_b ; in_proj_a   D.self_attention.in_proj = [q|k|v ; z ; beta ; alpha]
      conv1d, A_log, dt_bias, out_proj             same names under D.self_attention
      norm (plain gated RMSNorm)                   D.self_attention.out_norm
    full attention layer (L.self_attn):
      q_proj (per head [q_h; gate_h]), k_proj, v_proj   D.self_attention.linear_qkv: per query group
                                                   [q heads; gate heads; k; v] (megatron's attention_output_gate)
      o_proj / q_norm / k_norm                     linear_proj / q_layernorm / k_layernorm
    model.embed_tokens / model.norm / lm_head      embedding.word_embeddings / decoder.final_layernorm /
                                                   output_layer (absent when tied)

Every step is a concatenation or a row permutation: import then export gives the tensors back bitwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch

TEXT_PREFIX = "model."
"""HF tensor-name prefix of the text-only layout's language model (``hf/families/qwen35.py: PREFIXES``)."""


def model_fields(cfg: Any, multimodal: bool = False) -> dict[str, Any]:
    """The Qwen3.5-specific ``ModelConfig`` fields of a Qwen3.5 text config (the language model's: the family
    unpacks the multimodal layout); ValueError (one line) for what the model here does not compute: MTP layers
    are ignored, other features refused. ``multimodal``: the multimodal RoPE fields (``mrope_section``,
    ``mrope_interleaved``) are the vision-language model's (``model/vision_language.py``), not refused."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if getattr(cfg, "attention_bias", False):
        raise ValueError("Qwen3.5 config with attention_bias=True: attention biases are not supported")
    if (params.get("mrope_interleaved") and not multimodal) or params.get("rope_type", "default") != "default":
        raise ValueError(f"Qwen3.5 config with rope_parameters={params}: only default (text) RoPE is supported")
    return {
        "linear_attention_freq": [int(t == "linear_attention") for t in cfg.layer_types],
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "attention_output_gate": True,
        "rotary_percent": float(params.get("partial_rotary_factor", 1.0)),
        "layernorm_zero_centered_gamma": True,
    }


def _attention_heads(model_cfg: Any) -> tuple[int, int, int]:
    """(query heads, query groups, head dim)."""
    heads, groups = model_cfg.num_attention_heads, model_cfg.num_query_groups
    return heads, groups, model_cfg.kv_channels or model_cfg.hidden_size // heads


def _qkv_to_megatron(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model_cfg: Any) -> torch.Tensor:
    """HF ``q_proj [heads * 2d, h]`` (per head ``[q_h; gate_h]``), ``k_proj``, ``v_proj [groups * d, h]`` ->
    megatron ``linear_qkv [groups * (2 * heads/groups + 2) * d, h]``."""
    heads, groups, d = _attention_heads(model_cfg)
    hidden = q_gate.shape[-1]
    q, gate = q_gate.view(groups, heads // groups, 2, d, hidden).unbind(2)  # [g, heads/g, d, h] each
    blocks = [q.reshape(groups, -1, hidden), gate.reshape(groups, -1, hidden), k.view(groups, d, hidden),
              v.view(groups, d, hidden)]
    return torch.cat(blocks, dim=1).reshape(-1, hidden)


def _qkv_to_hf(qkv: torch.Tensor, model_cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``_qkv_to_megatron``."""
    heads, groups, d = _attention_heads(model_cfg)
    hidden = qkv.shape[-1]
    per = heads // groups
    q, gate, k, v = qkv.view(groups, -1, hidden).split([per * d, per * d, d, d], dim=1)
    q_gate = torch.stack([q.reshape(groups, per, d, hidden), gate.reshape(groups, per, d, hidden)], dim=2)
    return q_gate.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _gdn_sections(model_cfg: Any) -> list[int]:
    """Rows of HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (megatron's in_proj, in this order)."""
    qk = model_cfg.linear_key_head_dim * model_cfg.linear_num_key_heads
    v = model_cfg.linear_value_head_dim * model_cfg.linear_num_value_heads
    return [2 * qk + v, v, model_cfg.linear_num_value_heads, model_cfg.linear_num_value_heads]


_GDN_SAME = ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight")
_ATTN_RENAMES = {"o_proj.weight": "linear_proj.weight", "q_norm.weight": "q_layernorm.weight",
                 "k_norm.weight": "k_layernorm.weight"}
_NORM_RENAMES = {"input_layernorm.weight": "input_layernorm.weight",
                 "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}


def hf_to_megatron(hf_state: dict[str, torch.Tensor], model_cfg: Any, prefix: str = TEXT_PREFIX
                   ) -> dict[str, torch.Tensor]:
    """A full (TP1/PP1) megatron state dict from a Qwen3.5 transformers state dict (``prefix``: the layout's
    language-model names; tensors outside the language model are ignored). KeyError naming a missing HF tensor."""
    p = prefix
    out = {"embedding.word_embeddings.weight": hf_state[f"{p}embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state[f"{p}norm.weight"]}
    if not model_cfg.share_embeddings_and_output_weights:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for i, linear in enumerate(model_cfg.linear_attention_freq):
        hf, mc = f"{p}layers.{i}.", f"decoder.layers.{i}."
        for src, dst in _NORM_RENAMES.items():
            out[mc + dst] = hf_state[hf + src]
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([hf_state[hf + "mlp.gate_proj.weight"],
                                                       hf_state[hf + "mlp.up_proj.weight"]])
        out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
        if linear:
            la, sa = hf + "linear_attn.", mc + "self_attention."
            out[sa + "in_proj.weight"] = torch.cat([hf_state[la + f"in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")])
            out[sa + "out_norm.weight"] = hf_state[la + "norm.weight"]
            for name in _GDN_SAME:
                out[sa + name] = hf_state[la + name]
        else:
            at, sa = hf + "self_attn.", mc + "self_attention."
            out[sa + "linear_qkv.weight"] = _qkv_to_megatron(hf_state[at + "q_proj.weight"], hf_state[at + "k_proj.weight"],
                                                             hf_state[at + "v_proj.weight"], model_cfg)
            for src, dst in _ATTN_RENAMES.items():
                out[sa + dst] = hf_state[at + src]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], model_cfg: Any, prefix: str = TEXT_PREFIX
                   ) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_megatron`` (language-model tensors; vocabulary rows beyond ``model_cfg.vocab_size``,
    the TP padding, are dropped). ``full`` may hold one pipeline stage only (``iter_stage_weights``): the layers,
    embedding, final norm and output layer it lacks are left out."""
    p, vocab = prefix, model_cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    for src, dst in (("embedding.word_embeddings.weight", f"{p}embed_tokens.weight"),
                     ("decoder.final_layernorm.weight", f"{p}norm.weight"), ("output_layer.weight", "lm_head.weight")):
        if src in full and not (dst == "lm_head.weight" and model_cfg.share_embeddings_and_output_weights):
            out[dst] = full[src][:vocab] if src != "decoder.final_layernorm.weight" else full[src]
    for i, linear in enumerate(model_cfg.linear_attention_freq):
        hf, mc = f"{p}layers.{i}.", f"decoder.layers.{i}."
        if mc + "mlp.linear_fc2.weight" not in full:  # another pipeline stage's layer
            continue
        for src, dst in _NORM_RENAMES.items():
            out[hf + src] = full[mc + dst]
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = full[mc + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.down_proj.weight"] = full[mc + "mlp.linear_fc2.weight"]
        sa = mc + "self_attention."
        if linear:
            la = hf + "linear_attn."
            parts = full[sa + "in_proj.weight"].split(_gdn_sections(model_cfg))
            for x, part in zip(("qkv", "z", "b", "a"), parts):
                out[la + f"in_proj_{x}.weight"] = part
            out[la + "norm.weight"] = full[sa + "out_norm.weight"]
            for name in _GDN_SAME:
                out[la + name] = full[sa + name]
        else:
            at = hf + "self_attn."
            q, k, v = _qkv_to_hf(full[sa + "linear_qkv.weight"], model_cfg)
            out[at + "q_proj.weight"], out[at + "k_proj.weight"], out[at + "v_proj.weight"] = q, k, v
            for src, dst in _ATTN_RENAMES.items():
                out[at + src] = full[sa + dst]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def read_safetensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of ``hf_dir`` (one file or shards), on CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def load_weights(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                 prefix: str) -> None:
    """Copy a Qwen3.5 checkpoint into this rank's model chunks (any TP/PP layout; collective only where
    ``model/weights.py: load_full_state_dict`` is). Every rank reads the whole checkpoint: host memory is one
    full copy per rank (mbridge, used for the other families, reads on TP rank 0 and scatters)."""
    from megatron_rl.model.weights import load_full_state_dict

    full = hf_to_megatron(read_safetensors(hf_dir), model_cfg, prefix)
    for chunk in model_chunks:
        load_full_state_dict(chunk, full, groups)


def iter_weights(model_chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, groups: Any, model_cfg: Any,
                 prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor on CPU)`` of the model in ``hf_dir``'s layout, then, unchanged, every tensor of
    the source checkpoint the model here does not hold (the vision tower of the multimodal layout, MTP layers),
    so that transformers loads the result as it loaded the source. Collective (``full_state_dict``): run it to
    the end on every rank."""
    from megatron_rl.model.weights import full_state_dict

    full: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        full.update(full_state_dict(chunk, groups))
    language = megatron_to_hf(full, model_cfg, prefix)
    yield from language.items()
    for name, tensor in read_safetensors(hf_dir).items():
        if name not in language:
            yield name, tensor


class StageStream:
    """The per-stage weight stream of a Qwen3.5 model (``hf/weights.py: iter_stage_hf_weights`` with this as its
    ``bridge``): the model's config and layout, read once (a weight sync then reads no file)."""

    def __init__(self, model_cfg: Any, prefix: str = TEXT_PREFIX) -> None:
        self.model_cfg, self.prefix = model_cfg, prefix

    def iter_stage_weights(self, model_chunks: list[torch.nn.Module], groups: Any
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor on CPU)`` of this pipeline stage's language-model weights, yielded on TP rank 0
        only (the weight sync's sender); collective over the TP group (``full_state_dict`` gathers the stage on
        every TP rank: one full copy of the stage each, unlike mbridge's stream of one tensor at a time). Only
        the model's tensors: vLLM keeps the vision tower and drops MTP layers (``Qwen3_5ForCausalLM``)."""
        from megatron_rl.model.weights import full_state_dict

        stage: dict[str, torch.Tensor] = {}
        for chunk in model_chunks:
            stage.update(full_state_dict(chunk, groups, all_stages=False))
        if groups.tp_rank == 0:
            yield from megatron_to_hf(stage, self.model_cfg, self.prefix).items()
