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
