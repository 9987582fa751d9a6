"""Gradient-scaling contract (model/scaling.py) against a loop simulation of megatron-core's arithmetic.

The multi-rank invariance test (the real schedule + DDP) is in test_policy_multirank.py; here the schedule's
in-place division and DDP's average are replayed by hand on plain tensors.
"""

import torch

from megatron_rl.model.scaling import megatron_loss_scale, scale_loss_for_megatron


def test_simulated_schedule_and_ddp_give_global_sum_gradient():
    torch.manual_seed(0)
    dp_size, num_mb, cp_size = 3, 4, 1
    w = torch.randn(5)
    data = torch.randn(dp_size, num_mb, 7, 5)
    # Reference: gradient of the global summed loss.
    w_ref = w.clone().requires_grad_()
    (data @ w_ref).pow(2).sum().backward()
    # Megatron path: per rank, per micro-batch, schedule does loss *= cp; loss /= num_mb; DDP averages.
    grads = []
    for d in range(dp_size):
        w_d = w.clone().requires_grad_()
        for m in range(num_mb):
            loss, _ = scale_loss_for_megatron((data[d, m] @ w_d).pow(2).sum(), {}, num_microbatches=num_mb,
                                              dp_size=dp_size)
            loss *= cp_size
            loss /= num_mb
            loss.backward()
        grads.append(w_d.grad)
    torch.testing.assert_close(torch.stack(grads).mean(0), w_ref.grad, rtol=1e-6, atol=1e-6)


def test_reported_values_do_not_alias_the_loss():
    loss = torch.tensor(3.0, requires_grad=True) * 1.0
    reported_tensor = loss.detach()
    scaled, reported = scale_loss_for_megatron(loss, {"loss": reported_tensor}, num_microbatches=2, dp_size=2)
    with torch.no_grad():
        scaled /= 2  # the schedule's in-place division
        reported_tensor /= 10  # even the caller's own tensor changing later does not leak in
    assert float(reported["loss"]) == 3.0
    assert megatron_loss_scale(2, 2) == 4 and float(scaled.detach()) == 6.0
