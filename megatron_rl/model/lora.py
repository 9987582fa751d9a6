"""LoRA adapters on megatron-core's linear layers, exact under TP, PP, DP, CP and sequence parallelism.

Place in the data flow (docs/LORA.md): ``MegatronPolicy`` calls ``apply_lora`` on its freshly built GPTModel stage,
before the DDP wrapper, when ``model.lora.rank > 0``. The base weights are frozen (``requires_grad=False``: no
gradient, no DDP grad buffer, no optimizer state; megatron-core 0.16.1 and 0.19.2 skip such parameters in DDP,
``get_megatron_optimizer`` and ``finalize_model_grads``), and only the adapters train.

One adapter per Hugging Face module, as ``peft`` has them, so that export is a copy (no re-fitting):

    HF module            megatron linear                      per TP rank                     adapter (A [r, in], B [out, r])
    q_proj k_proj v_proj self_attention.linear_qkv (column)  rows of G/tp query groups      A whole; B rows split over TP
    o_proj               self_attention.linear_proj (row)     columns split over TP          A columns split; B whole
    gate_proj up_proj    mlp.linear_fc1 (column, [gate; up])  [gate_r; up_r]                 A whole; B rows split over TP
    down_proj            mlp.linear_fc2 (row)                 columns split over TP          A columns split; B whole

A rank's B rows of q_proj (k_proj, v_proj, gate_proj, up_proj) are chunk ``tp_rank`` of the HF B, so
``model.weights.full_state_dict`` unshards adapters with plain concatenation (``tensor_model_parallel`` and
``partition_dim`` are set as megatron sets them on its own weights). The fused layouts are rebuilt per rank:
QKV's local output is per query group ``[q heads of the group; k; v]`` (``_qkv_layout``), fc1's is
``[gate_r; up_r]``.

Forward (a hook adds ``scale * B @ A x`` to the linear's output; ``scale = alpha / r``), with the collectives of
megatron's own linears applied to the rank-r activation ``u = A x``:

    column, no SP   u = A x; copy_to_tensor_model_parallel_region(u)   backward all-reduces du over TP
    column, SP      x is this rank's sequence shard; u = A x; gather_from_sequence_parallel_region(u)
                    (backward reduce-scatters du); A's gradient covers this rank's tokens only: A is marked
                    ``sequence_parallel`` so that ``finalize_model_grads`` sums it over TP (as for the norms)
    row, no SP      u = reduce_from_tensor_model_parallel_region(A_r x_r)   (A_r x_r is a partial sum over TP)
    row, SP         u = reduce_scatter_to_sequence_parallel_region(A_r x_r); B's gradient covers this rank's
                    tokens only: B is marked ``sequence_parallel``

Context parallelism needs nothing: the linears are per token. Under PP each stage adapts its own layers. B starts
at zero, so step 0 is the base model exactly; A is drawn like ``peft``'s (Kaiming-uniform, a = sqrt(5): U(-1/sqrt(in),
1/sqrt(in))) from a generator seeded by (seed, global layer, module), whole, then sharded: every layout starts
from the same adapters. Only the local layer spec's linears are adapted (TransformerEngine fuses the input norm
into ``linear_qkv``/``linear_fc1``, so the hook would see the un-normalized input); MoE experts carry none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_rl.config import LORA_TARGET_MODULES, ModelConfig
from megatron_rl.distributed.bootstrap import ParallelGroups

ADAPTER = "lora"
"""Name of the adapter child of an adapted linear: its tensors are ``<linear>.lora.<hf module>.lora_{A,B}``."""

LINEARS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "linear_qkv": ("self_attention", "column", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attention", "row", ("o_proj",)),
    "linear_fc1": ("mlp", "column", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", "row", ("down_proj",)),
}
"""megatron linear -> (parent module, parallel kind, the HF modules it fuses, in its output order)."""


def is_adapter_name(name: str) -> bool:
    """Whether a (local or full) state-dict key is a LoRA adapter tensor."""
    return f".{ADAPTER}." in name


class LoRAPair(torch.nn.Module):
    """The adapter of one HF module on this rank: ``lora_A`` [r, in_local], ``lora_B`` [out_local, r]."""

    def __init__(self, a: torch.Tensor, out_rows: int) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(a.new_zeros(out_rows, a.shape[0]))


class LinearAdapter(torch.nn.Module):
    """The adapters of one megatron linear (one ``LoRAPair`` per targeted HF module) and their forward.

    ``parts``: every HF module the linear fuses, ``(name, local output rows)``, in its output order; untargeted
    ones contribute zero. ``qkv_groups``: local query groups of a fused QKV (None otherwise).
    """

    def __init__(self, kind: str, parts: list[tuple[str, int]], pairs: dict[str, LoRAPair], *, scale: float,
                 groups: ParallelGroups, qkv_groups: int | None = None) -> None:
        super().__init__()
        self.kind, self.parts, self.scale, self.qkv_groups = kind, parts, scale, qkv_groups
        self.pairs = torch.nn.ModuleDict(pairs)
        self.tp_group, self.sequence_parallel = groups.tp_group, groups.sequence_parallel
        self._mark_parallel(groups.tp_size)

    def _mark_parallel(self, tp_size: int) -> None:
        """megatron's TP attributes (grad norm, unsharding) and the SP marks for the TP gradient sum."""
        for pair in self.pairs.values():
            split, whole = (pair.lora_B, pair.lora_A) if self.kind == "column" else (pair.lora_A, pair.lora_B)
            tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if self.kind == "column" else 1, 1)
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
            if self.sequence_parallel and tp_size > 1:
                whole.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B @ A x`` in the linear's local output layout: x [s(/tp), b, in(/tp)] -> [s(/tp), b, out/tp]."""
        names = list(self.pairs)
        a = torch.cat([self.pairs[n].lora_A for n in names]) if len(names) > 1 else self.pairs[names[0]].lora_A
        u = x @ a.t()  # [s, b, n*r]
        if self.kind == "column":
            u = (tensor_parallel.gather_from_sequence_parallel_region(u, group=self.tp_group)
                 if self.sequence_parallel else
                 tensor_parallel.copy_to_tensor_model_parallel_region(u, group=self.tp_group))
        else:
            u = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
                 if self.sequence_parallel else
                 tensor_parallel.reduce_from_tensor_model_parallel_region(u, group=self.tp_group))
        pieces = dict(zip(names, u.chunk(len(names), dim=-1)))
        deltas = []
        for name, rows in self.parts:
            if name in pieces:
                deltas.append(pieces[name] @ self.pairs[name].lora_B.t())  # [s, b, rows]
            else:
                deltas.append(u.new_zeros(*u.shape[:-1], rows))
        out = _qkv_layout(deltas, self.qkv_groups) if self.qkv_groups is not None else torch.cat(deltas, dim=-1)
        return out * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` of every fused HF module in this rank's weight layout: [out/tp, in] (column) or
        [out, in/tp] (row), the shape of the linear's local weight; no collective."""
        a_any = next(iter(self.pairs.values())).lora_A  # [r, in_local]
        deltas = [(self.pairs[name].lora_B @ self.pairs[name].lora_A).t() if name in self.pairs
                  else a_any.new_zeros(a_any.shape[1], rows) for name, rows in self.parts]  # [in_local, rows]
        fused = _qkv_layout(deltas, self.qkv_groups) if self.qkv_groups is not None else torch.cat(deltas, dim=-1)
        return fused.t() * self.scale


def _qkv_layout(deltas: list[torch.Tensor], num_groups: int) -> torch.Tensor:
    """q [.., G*Hg*D], k [.., G*D], v [.., G*D] -> megatron's fused QKV rows, per group [q_g; k_g; v_g]."""
    lead = deltas[0].shape[:-1]
    per_group = [d.reshape(*lead, num_groups, -1) for d in deltas]
    return torch.cat(per_group, dim=-1).reshape(*lead, -1)


def _output_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of an adapted linear: its ``(output, bias)`` with the adapter's delta added."""
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + getattr(module, ADAPTER)(x), bias


def _init_a(rank: int, in_features: int, seed: int, layer: int, module_index: int) -> torch.Tensor:
    """The whole A [r, in] of one HF module, the same under every layout (``peft``'s Kaiming-uniform bound)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 16 + module_index) % (2**63))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _parts(linear_name: str, linear: torch.nn.Module, model_cfg: ModelConfig, tp_size: int
           ) -> tuple[list[tuple[str, int]], int | None]:
    """Every HF module of ``linear`` with its local output rows; the local query groups of a QKV."""
    names = LINEARS[linear_name][2]
    out_local = linear.weight.shape[0]
    if linear_name == "linear_qkv":
        groups = model_cfg.num_query_groups // tp_size
        head_dim = model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads
        q_rows = model_cfg.num_attention_heads // tp_size * head_dim
        return [("q_proj", q_rows), ("k_proj", groups * head_dim), ("v_proj", groups * head_dim)], groups
    return [(name, out_local // len(names)) for name in names], None


def apply_lora(module: torch.nn.Module, model_cfg: ModelConfig, groups: ParallelGroups, *, seed: int) -> None:
    """Add adapters to this stage's targeted linears (forward hooks) and freeze everything else.

    ValueError for a layer spec without megatron-core's plain linears (the TE spec) or an MoE MLP target.
    """
    lora = model_cfg.lora
    assert lora.enabled, "apply_lora needs model.lora.rank > 0"
    targets = set(lora.target_modules)
    for param in module.parameters():
        param.requires_grad_(False)
    for layer in module.decoder.layers:
        for linear_name, (parent_name, kind, hf_names) in LINEARS.items():
            wanted = [n for n in hf_names if n in targets]
            if wanted:
                linear = getattr(getattr(layer, parent_name), linear_name, None)
                _adapt(linear, linear_name, kind, wanted, layer.layer_number - 1, model_cfg, groups, seed)


def _adapt(linear: torch.nn.Module | None, linear_name: str, kind: str, wanted: list[str], layer: int,
           model_cfg: ModelConfig, groups: ParallelGroups, seed: int) -> None:
    expected = ColumnParallelLinear if kind == "column" else RowParallelLinear
    if type(linear) is not expected:
        raise ValueError(f"model.lora targets {wanted} but layer {layer}'s {linear_name} is "
                         f"{type(linear).__name__}, not megatron-core's {expected.__name__}; LoRA needs the local layer "
                         "spec (model.attention_backend='local' or 'auto') and, for MoE models, attention targets only")
    lora = model_cfg.lora
    parts, qkv_groups = _parts(linear_name, linear, model_cfg, groups.tp_size)
    in_local = linear.weight.shape[1]
    in_full = in_local * groups.tp_size if kind == "row" else in_local
    pairs = {}
    for name in wanted:
        a = _init_a(lora.rank, in_full, seed, layer, LORA_TARGET_MODULES.index(name))
        if kind == "row":
            a = a.chunk(groups.tp_size, dim=1)[groups.tp_rank]
        rows = dict(parts)[name]
        pairs[name] = LoRAPair(a.to(linear.weight.device, linear.weight.dtype).contiguous(), rows)
    adapter = LinearAdapter(kind, parts, pairs, scale=lora.scale, groups=groups, qkv_groups=qkv_groups)
    linear.add_module(ADAPTER, adapter)
    linear.register_forward_hook(_output_hook, with_kwargs=True)


def adapter_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(local name, parameter)`` of this stage's adapters."""
    for name, param in module.named_parameters():
        if is_adapter_name(name):
            yield name, param


_FULL_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.linear_\w+\.lora\.pairs\.(\w+)\.(lora_[AB])$")
_HF_PARENT = {"self_attention": "self_attn", "mlp": "mlp"}


def peft_name(full_name: str) -> str:
    """An adapter's key in a full state dict (``model.weights.full_state_dict``) -> its ``peft`` name:
    ``decoder.layers.3.self_attention.linear_qkv.lora.pairs.q_proj.lora_A`` ->
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (A [r, in], B [out, r], as in peft)."""
    match = _FULL_NAME.match(full_name)
    assert match is not None, f"not an adapter of a full state dict: {full_name}"
    layer, parent, module, which = match.groups()
    return f"base_model.model.model.layers.{layer}.{_HF_PARENT[parent]}.{module}.{which}.weight"


_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def merged_weight(linear: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A new tensor ``W + scale * B @ A`` (this rank's shard, megatron's TP attributes copied) for an adapted
    linear's ``weight``; the weight itself is untouched. For export and weight sync: one tensor at a time."""
    merged = weight.detach() + getattr(linear, ADAPTER).delta_weight().to(weight.dtype)
    for attribute in _TP_ATTRIBUTES:
        if hasattr(weight, attribute):
            setattr(merged, attribute, getattr(weight, attribute))
    return merged


def adapted_linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{local name of the weight: its linear}`` for every adapted linear of this stage (empty without LoRA)."""
    return {f"{name}.weight": linear for name, linear in module.named_modules()
            if isinstance(getattr(linear, ADAPTER, None), LinearAdapter)}
