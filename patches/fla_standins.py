"""P12: torch stand-ins for flash-linear-attention's three functions in megatron-core's Gated-DeltaNet (docs/QWEN35.md).

megatron-core's ``GatedDeltaNet`` (``ssm/gated_delta_net/``, packed THD input since 0.18) imports ``l2norm``,
``causal_conv1d`` and ``chunk_gated_delta_rule`` from fla (flash-linear-attention) and raises "FLA is not
installed" in ``_GDNBase.__init__`` without it. fla's kernels are Triton: they do not run on a CPU (measured with
fla-core 0.6.0: "0 active drivers"). Its torch-native fallback (``deterministic_mode``) refuses packed input
(``gdn.py``: "Packed sequence does not support deterministic mode"). Where fla cannot be imported, this patch
puts pure-torch versions in their place:

    l2norm                   x * rsqrt(sum(x^2) + eps) over the last dim, in fp32 (fla's formula)
    causal_conv1d            depthwise ``F.conv1d`` + activation
    chunk_gated_delta_rule   megatron-core's own ``torch_chunk_gated_delta_rule`` (the transformers reference)

With ``cu_seqlens`` both move each packed sequence into its own batch row (zero-padded at its end to the
longest) and back: that is what keeps packed sequences apart, every sequence's convolution window and
recurrent state start at zero (fla's varlen kernels do the same in one launch). ``HAVE_FLA`` is
set so that the layer builds. The ``jit_fuser`` (``torch.compile``) methods these models call, three of
``_GDNBase`` and the gated attention's ``Attention._apply_output_gate``, are restored to their plain functions:
on a CPU their first calls compile for 10-40 s per process, for no gain here.

On a GPU machine without fla the same stand-ins run on CUDA (one sequence at a time, so slower than fla's kernels;
``model/hybrid.py`` warns; not yet run on a GPU: tests/hf/test_hf_qwen35.py has the ``gpu`` test); where fla is
installed its Triton kernels run and this patch does nothing.

Target megatron-core==0.19.2 (0.16.1 has no packed GDN: megatron_rl refuses hybrid models there). A no-op where
the module is absent or fla is importable. Remove when fla (or megatron-core) has a CPU varlen path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl import patches

_FUSED_METHODS = ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's ``l2norm``: ``x / sqrt(sum(x^2, -1) + eps)`` computed in fp32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(output_dtype or x.dtype)


def _segments(length: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each packed sequence (one segment without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return [(0, length)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _rows(x: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """``x [1, T, ...]`` -> ``[n, L, ...]``: packed sequence i in row i, zero-padded at its end to the longest
    ``L`` (a causal computation never lets trailing zeros reach earlier positions)."""
    if len(segments) == 1 and segments[0] == (0, x.shape[1]):
        return x
    assert x.shape[0] == 1, "packed input has batch 1"
    longest = max(end - start for start, end in segments)
    rows = x.new_zeros(len(segments), longest, *x.shape[2:])
    for i, (start, end) in enumerate(segments):
        rows[i, : end - start] = x[0, start:end]
    return rows


def _unrows(rows: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """Inverse of ``_rows``: ``[n, L, ...]`` -> ``[1, T, ...]``."""
    if len(segments) == 1 and segments[0][0] == 0 and rows.shape[0] == 1 and rows.shape[1] == segments[0][1]:
        return rows
    return torch.cat([rows[i, : end - start] for i, (start, end) in enumerate(segments)])[None]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, **unused: object
                  ) -> tuple[torch.Tensor, None]:
    """fla's ``causal_conv1d``: ``x [b, s, d]``, depthwise ``weight [d, w]`` -> ``([b, s, d], None)``; with
    ``cu_seqlens`` (``b`` = 1) each packed sequence is convolved in its own batch row, its window starting at zero."""
    assert initial_state is None and not output_final_state, "the training path passes no conv state"
    segments = _segments(x.shape[1], cu_seqlens)
    rows = _rows(x, segments).transpose(1, 2)  # [n, d, L]
    width = weight.shape[-1]
    out = F.conv1d(rows, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])[..., : rows.shape[-1]]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    else:
        assert activation is None, f"unsupported conv activation {activation!r}"
    return _unrows(out.transpose(1, 2), segments), None


def _chunk_rule(reference):
    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
        """fla's ``chunk_gated_delta_rule`` (``q, k [b, s, h, dk]``, ``v [b, s, h, dv]``, ``g, beta [b, s, h]``)
        -> ``([b, s, h, dv], None)``: megatron's torch reference with each packed sequence in its own batch row
        (its recurrent state starts at zero; the zero padding after it is never read by it)."""
        assert initial_state is None and not output_final_state, "the training path passes no recurrent state"
        segments = _segments(q.shape[1], cu_seqlens)
        out, _ = reference(*(_rows(t, segments) for t in (q, k, v, g, beta)),
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _unrows(out, segments), None

    return chunk_gated_delta_rule


def _unfused(method):
    """The plain function under megatron's ``jit_fuser`` (``torch.compile``) decorator."""
    return getattr(method, "_torchdynamo_orig_callable", None) or getattr(method, "__wrapped__", method)


def _install() -> None:
    try:
        from megatron.core.ssm.gated_delta_net import common, gdn
    except ImportError:  # megatron-core without the packed GDN package (0.16.1): nothing to patch
        return
    if common.HAVE_FLA:
        return
    rule = _chunk_rule(common.torch_chunk_gated_delta_rule)
    common.l2norm = l2norm
    common.causal_conv1d = gdn.causal_conv1d = causal_conv1d
    common.chunk_gated_delta_rule = gdn.chunk_gated_delta_rule = rule
    common.HAVE_FLA = True
    for name in _FUSED_METHODS:
        setattr(common._GDNBase, name, _unfused(getattr(common._GDNBase, name)))
    from megatron.core.transformer.attention import Attention

    Attention._apply_output_gate = _unfused(Attention._apply_output_gate)


PATCHES = [
    patches.Patch(
        name="P12 fla stand-ins for Gated-DeltaNet",
        versions=("0.19.2",),
        reason=(
            "ssm/gated_delta_net/common.py imports l2norm, causal_conv1d, chunk_gated_delta_rule from fla (Triton, "
            "no CPU driver) and _GDNBase.__init__ raises without it; the torch fallback refuses packed input; "
            "its jit_fuser methods (and Attention._apply_output_gate) compile for 10-40 s on a CPU"
        ),
        removal="fla runs on CPU with cu_seqlens, or megatron-core's torch GDN path accepts packed sequences",
        apply=_install,
        on_cuda=True,
    ),
]
