"""The gradient-scaling contract between our summed losses and megatron-core (docs/DESIGN.md section 5).

Place in the data flow: ``loss_fn`` (algorithms/) returns a *summed* per-token loss for one micro-batch on one
DP rank; this module turns it into the value handed to megatron-core's pipeline schedule, so that after
``finalize_model_grads`` every parameter's gradient equals the gradient of the single global sum over the
whole mini-batch (all micro-batches, all DP ranks). This is the only place where that arithmetic lives.

Derivation (megatron-core 0.16.1 and 0.19.2, measured in docs/CPU_ADAPTATION.md section 4; tested with
context parallelism in tests/cp/test_cp_policy.py):

    Let L = sum over DP ranks d and micro-batches m of L_{d,m}   (the global summed loss we want to train on).
    Context parallelism (cp ranks per DP rank): CP rank c runs the model on its tokens only, but its per-token
    outputs are all-gathered over CP (model/context_parallel.py ``gather_tokens``) so EVERY CP rank computes
    the whole L_{d,m}; the gather's backward keeps the rank's own slice. Hence rank c's local gradient is
    g_c = d L_{d,m} / d theta through c's tokens only (c's queries; its keys/values receive the other ranks'
    contributions through the K/V gather's reduce-scatter), and sum_c g_c = grad(L_{d,m}).
    The schedule (forward_step_calc_loss, 2-tuple return) does, on the last PP stage, in place:
        loss *= cp_size ;  loss /= num_microbatches
    DDP (finalize_model_grads -> finish_grad_sync) averages gradients over the DP x CP group:
        grad = (1 / (dp_size * cp_size)) * sum over the DP x CP group of the local grads
    With the value handed to the schedule s * L_{d,m}, the final gradient is
        (1 / (dp * cp)) * sum_{d,c} sum_m  (s * cp / num_microbatches) * g_{c}(L_{d,m})
      = s / (dp * num_microbatches) * sum_{d,m} sum_c g_c(L_{d,m})
      = s / (dp * num_microbatches) * grad(L)
    so s = num_microbatches * dp_size gives exactly grad(L), for every cp: the schedule's cp and DDP's 1/cp
    cancel. (Had each CP rank computed the loss of its own tokens only, sum_c g_c would still be grad(L_{d,m})
    and s the same; a gather whose backward summed the CP ranks' gradients would give cp * grad(L).) Dropping
    the schedule's factor (s / cp) or adding one (s * cp) breaks the multi-rank gradient tests.

Mixture-of-experts auxiliary losses (model/moe.py; docs/MOE.md section 3). megatron-core's own aux and z losses
bypass the value above: ``MoEAuxLossAutoScaler`` injects ``loss_scale * cp / num_microbatches`` as their
gradient (``schedules.py`` ~351-361 in 0.19.2, ~282-292 in 0.16.1; ``loss_scale`` from ``moe_grad_scale_func`` in
0.19.2, ``grad_scale_func`` in 0.16.1, else 1), so after DDP's 1/(dp*cp) they train the *mean* over micro-batches
and DP ranks of a per-micro-batch loss, whose value depends on how sequences were packed. megatron_rl leaves them
off (coefficient 0) and adds its own terms, which are sums over the call's sequences and tokens:

    A = sum over DP ranks d, CP ranks c (and TP ranks under sequence parallelism) and micro-batches m of
        a_{d,c,m}, the part of J_aux + J_z over the tokens rank (d, c) runs in micro-batch m
        (each a already carries 1/N_seq or 1/N_tok of the whole call; expert counts are all-reduced over the
        ranks sharing a sequence, so sum_c a_{d,c,m} is the exact loss of micro-batch m's sequences)
    The router attaches a_{d,c,m} with the gradient factor g (``_AddLossGradient``, not the schedule), and DDP
    averages over DP x CP (expert gradients too: megatron-core scales them by 1/(dp*cp) and sums over the
    expert-data-parallel group, whose experts saw every DP rank's tokens through the all-to-all):
        (1 / (dp * cp)) * sum_{d,c,m} g * grad(a_{d,c,m}) = g / (dp * cp) * grad(A)
    so g = dp * cp (``moe_grad_scale``) gives exactly grad(J_aux + J_z), independent of num_microbatches.
    Under TP without sequence parallelism every TP rank computes the same a (as for the policy loss), and the
    router weight is not all-reduced over TP: no factor. (megatron-core refuses MoE with TP but without SP.)
Tested in tests/moe/test_moe_invariance.py (EP2, EP2xDP2, EP2xTP2, EP2xPP2, TP2, CP2 x 1/2/4 micro-batches against
one process; g = 1 planted fails).

The schedule divides *in place*: a reported metric that shares storage with the loss would be divided too, so
reported values are detached copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def megatron_loss_scale(num_microbatches: int, dp_size: int) -> int:
    """Factor ``s`` applied to a summed micro-batch loss before megatron-core sees it (derivation above): the
    same for every context-parallel size."""
    assert num_microbatches >= 1 and dp_size >= 1, (num_microbatches, dp_size)
    return num_microbatches * dp_size


def moe_grad_scale(dp_size: int, cp_size: int) -> float:
    """Gradient factor of the MoE auxiliary-loss terms (derivation above): cancels DDP's mean over DP x CP."""
    assert dp_size >= 1 and cp_size >= 1, (dp_size, cp_size)
    return float(dp_size * cp_size)


def scale_loss_for_megatron(
    summed_loss: torch.Tensor,
    reported: Mapping[str, Any],
    *,
    num_microbatches: int,
    dp_size: int,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The 2-tuple a megatron-core ``loss_func`` returns: ``(scaled_loss, reported)``.

    summed_loss: scalar, the micro-batch's summed loss on this DP rank (keeps its autograd graph).
    reported: anything picklable (we pass ``dict[str, Metric]`` of floats); copied so it never aliases the
        loss that the schedule later divides in place.
    """
    assert summed_loss.dim() == 0, f"summed_loss must be a scalar, got shape {tuple(summed_loss.shape)}"
    scaled = summed_loss * megatron_loss_scale(num_microbatches, dp_size)
    return scaled, {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in reported.items()}
