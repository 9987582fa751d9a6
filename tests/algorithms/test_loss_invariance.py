"""The invariance that justifies putting the reduction in the advantages (docs/DESIGN.md section 5), in plain torch.

For one mini-batch and each ``loss_reduction``: (a) the gradient of the summed loss on the whole mini-batch,
(b) the summed gradients over random splits into simulated DP shards (with dummy padding rows) and uneven
micro-batches, and (c) a direct loop formula of the reduction (e.g. token_mean = mean over all valid tokens)
agree to fp32 tolerance, KL and entropy mean terms included, and with every off-policy correction (token and
sequence importance weights against the rollout log-probs, truncated or masked: ``algorithms/off_policy.py``).
The old "mean of micro-batch means" is shown to differ on an uneven split, so the comparison can fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.support.alg_helpers import right_aligned_mask

from megatron_rl.algorithms import (
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    LossContext,
    kl_penalty,
    normalize_minibatch_advantages,
    policy_loss_fn,
    value_loss_fn,
)
from megatron_rl.algorithms.normalization import LOSS_REDUCTIONS
from megatron_rl.config import AlgorithmConfig
from megatron_rl.metrics import finalize_metrics, merge_metrics

ROWS, WIDTH, VOCAB, MAX_SEQ_LEN = 10, 8, 5, 12
KL_COEF, ENT_COEF = 0.1, 0.01


def _minibatch():
    g = torch.Generator().manual_seed(0)
    lengths = [8, 1, 5, 0, 3, 7, 2, 8, 4, 6]  # uneven, with an empty row
    loss_mask = right_aligned_mask(lengths, WIDTH) * (torch.rand(ROWS, WIDTH, generator=g) > 0.15).float()
    logits = torch.randn(ROWS, WIDTH, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    lp, _ = _logprobs_entropy(logits, labels)
    return {
        "logits": logits, "labels": labels, "loss_mask": loss_mask,
        "old_logprobs": lp + 0.3 * torch.randn(ROWS, WIDTH, generator=g),
        "ref_logprobs": lp + 0.3 * torch.randn(ROWS, WIDTH, generator=g),
        "raw_advantages": torch.randn(ROWS, WIDTH, generator=g),
        # the sampler's log-probs: spread so that every off-policy mode clips or masks some units, not all
        "rollout_logprobs": lp + 0.5 * torch.randn(ROWS, WIDTH, generator=g),
    }


def _logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels[..., None])[..., 0], entropy


def _config(loss_type: str, off_policy_correction: str = "none") -> AlgorithmConfig:
    return AlgorithmConfig(policy_loss_type=loss_type, use_kl_loss=True, kl_loss_coef=KL_COEF,
                           entropy_loss_coef=ENT_COEF, eps_clip_low=0.2, eps_clip_high=0.3, max_seq_len=MAX_SEQ_LEN,
                           off_policy_correction=off_policy_correction, tis_cap=1.5,
                           is_ratio_low=0.8, is_ratio_high=1.25)  # every masking mode masks some units, not all


def _microbatch_loss(theta, rows: slice, mb_all: dict, ctx: LossContext):
    lp, ent = _logprobs_entropy(theta[rows], mb_all["labels"][rows])
    mb = {k: mb_all[k][rows] for k in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")}
    return policy_loss_fn(lp, ent, mb, ctx)


def _whole(b: dict, advantages: torch.Tensor, cfg: AlgorithmConfig):
    theta = b["logits"].clone().requires_grad_(True)
    ctx = LossContext.for_minibatch(cfg, b["loss_mask"])
    loss, metrics = _microbatch_loss(theta, slice(None), {**b, "advantages": advantages}, ctx)
    loss.backward()
    return loss.detach(), theta.grad, metrics


def _pad_rows(b: dict, advantages: torch.Tensor, n: int) -> dict:
    """DP padding: dummy rows with loss_mask 0 and zero advantages/logprobs."""
    pad = {k: torch.zeros((n,) + v.shape[1:], dtype=v.dtype) for k, v in b.items()}
    out = {k: torch.cat([v, pad[k]]) for k, v in b.items()}
    out["advantages"] = torch.cat([advantages, torch.zeros(n, WIDTH)])
    return out


def _random_split(rng: random.Random, rows: int) -> tuple[list[slice], int]:
    """Contiguous DP shards of a padded mini-batch, each cut into uneven micro-batches."""
    dp = rng.choice([1, 2, 3, 4])
    padded = -(-rows // dp) * dp
    shard = padded // dp
    slices = []
    for r in range(dp):
        cuts = sorted(rng.sample(range(1, shard), k=rng.randint(0, shard - 1))) if shard > 1 else []
        bounds = [0] + cuts + [shard]
        slices += [slice(r * shard + s, r * shard + e) for s, e in zip(bounds, bounds[1:])]
    return slices, padded - rows


def _split(b: dict, advantages: torch.Tensor, cfg: AlgorithmConfig, slices: list[slice], num_pad: int):
    padded = _pad_rows(b, advantages, num_pad)
    theta = padded["logits"].clone().requires_grad_(True)
    ctx = LossContext.for_minibatch(cfg, b["loss_mask"])  # the mini-batch's totals, not the padded shard's
    total, parts = torch.zeros(()), []
    for rows in slices:
        loss, metrics = _microbatch_loss(theta, rows, padded, ctx)
        total, parts = total + loss, parts + [metrics]
    total.backward()
    return total.detach(), theta.grad, merge_metrics(*parts)


def _reference(b: dict, reduction: str):
    """Direct loop formula on the RAW advantages: the reduction applied to the per-token PPO loss."""
    theta = b["logits"].clone().requires_grad_(True)
    lp, ent = _logprobs_entropy(theta, b["labels"])
    kl = kl_penalty(lp, b["ref_logprobs"], b["loss_mask"], "k3")
    mask = b["loss_mask"]
    tokens = [[t for t in range(WIDTH) if mask[i, t] > 0] for i in range(ROWS)]
    n_tok = sum(len(ts) for ts in tokens)

    def pg(i, t):
        r, a = torch.exp(lp[i, t] - b["old_logprobs"][i, t]), float(b["raw_advantages"][i, t])
        return torch.maximum(-a * r, -a * r.clamp(0.8, 1.3))

    row_sums = [sum((pg(i, t) for t in ts), torch.zeros(())) for i, ts in enumerate(tokens)]
    if reduction == "token_mean":
        pg_loss = sum(row_sums) / n_tok
    elif reduction == "sequence_mean":
        pg_loss = sum(s / max(1, len(ts)) for s, ts in zip(row_sums, tokens)) / ROWS
    else:
        pg_loss = sum(s / MAX_SEQ_LEN for s in row_sums) / ROWS
    mean_kl = sum(kl[i, t] for i, ts in enumerate(tokens) for t in ts) / n_tok
    mean_ent = sum(ent[i, t] for i, ts in enumerate(tokens) for t in ts) / n_tok
    loss = pg_loss + KL_COEF * mean_kl - ENT_COEF * mean_ent
    loss.backward()
    return loss.detach(), theta.grad


CORRECTIONS = [m for m in OFF_POLICY_CORRECTIONS if m != "none"]
WHOLE_SPLIT_CASES = (
    [(reduction, loss_type, "none") for reduction in LOSS_REDUCTIONS for loss_type in sorted(POLICY_LOSSES)]
    # every correction with every loss (token_mean), and with every reduction (PPO): the weights are per token or
    # per whole row, so no split can change them
    + [("token_mean", loss_type, mode) for loss_type in sorted(POLICY_LOSSES) for mode in CORRECTIONS]
    + [(reduction, "regular", mode) for reduction in LOSS_REDUCTIONS if reduction != "token_mean"
       for mode in CORRECTIONS]
)


@pytest.mark.parametrize("reduction, loss_type, correction", WHOLE_SPLIT_CASES)
def test_whole_equals_any_split(reduction, loss_type, correction):
    b = _minibatch()
    cfg = _config(loss_type, correction)
    adv = normalize_minibatch_advantages(b["raw_advantages"], b["loss_mask"], reduction, MAX_SEQ_LEN)
    loss_a, grad_a, metrics_a = _whole(b, adv, cfg)
    rng = random.Random(f"{reduction}-{loss_type}-{correction}")  # deterministic (str seeds are not hashed)
    for _ in range(4):
        slices, num_pad = _random_split(rng, ROWS)
        loss_b, grad_b, metrics_b = _split(b, adv, cfg, slices, num_pad)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_b[:ROWS], grad_a, rtol=1e-5, atol=1e-7)
        assert torch.all(grad_b[ROWS:] == 0)  # DP padding rows contribute nothing
        final_a, final_b = finalize_metrics(metrics_a), finalize_metrics(metrics_b)
        assert final_a.keys() == final_b.keys()
        for name in final_a:
            if not name.endswith("_max"):
                assert abs(final_a[name] - final_b[name]) <= 1e-5 * max(1.0, abs(final_a[name])), name


@pytest.mark.parametrize("reduction", LOSS_REDUCTIONS)
def test_whole_equals_direct_formula(reduction):
    b = _minibatch()
    adv = normalize_minibatch_advantages(b["raw_advantages"], b["loss_mask"], reduction, MAX_SEQ_LEN)
    loss_a, grad_a, _ = _whole(b, adv, _config("regular"))
    loss_c, grad_c = _reference(b, reduction)
    torch.testing.assert_close(loss_a, loss_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_a, grad_c, rtol=1e-5, atol=1e-7)


def test_mean_of_microbatch_means_differs_on_uneven_split():
    """The old reduction (token mean per micro-batch, averaged over micro-batches) is not the mini-batch mean."""
    b = _minibatch()
    cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.3)  # no KL / entropy: isolate the policy term
    slices = [slice(0, 2), slice(2, 9), slice(9, 10)]  # uneven token counts
    naive_adv = torch.cat([normalize_minibatch_advantages(b["raw_advantages"][rows], b["loss_mask"][rows],
                                                          "token_mean") for rows in slices])
    theta = b["logits"].clone().requires_grad_(True)
    means = [_microbatch_loss(theta, rows, {**b, "advantages": naive_adv},
                              LossContext.for_minibatch(cfg, b["loss_mask"][rows]))[0] for rows in slices]
    (sum(means) / len(means)).backward()
    adv = normalize_minibatch_advantages(b["raw_advantages"], b["loss_mask"], "token_mean")
    _, grad_a, _ = _whole(b, adv, cfg)
    assert not torch.allclose(theta.grad, grad_a, rtol=1e-2, atol=1e-4)
    _, grad_b, _ = _split(b, adv, cfg, slices, 0)  # the same uneven split, reduction in the advantages
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", LOSS_REDUCTIONS)
def test_value_loss_whole_equals_any_split(reduction):
    """The critic follows the same reduction, from ``LossContext``, without touching the advantages."""
    b = _minibatch()
    g = torch.Generator().manual_seed(1)
    mb = {"loss_mask": b["loss_mask"], "returns": torch.randn(ROWS, WIDTH, generator=g),
          "values": torch.randn(ROWS, WIDTH, generator=g)}
    cfg = AlgorithmConfig(loss_reduction=reduction, max_seq_len=MAX_SEQ_LEN, value_clip=0.2)
    ctx = LossContext.for_minibatch(cfg, b["loss_mask"])
    preds = mb["values"] + torch.randn(ROWS, WIDTH, generator=g)

    def grad_of(slices):
        v = preds.clone().requires_grad_(True)
        sum(value_loss_fn(v[rows], None, {k: t[rows] for k, t in mb.items()}, ctx)[0] for rows in slices).backward()
        return v.grad

    whole = grad_of([slice(None)])
    rng = random.Random(reduction)
    for _ in range(3):
        slices, num_pad = _random_split(rng, ROWS)
        slices = [slice(s.start, min(s.stop, ROWS)) for s in slices if s.start < ROWS]  # no padding rows here
        torch.testing.assert_close(grad_of(slices), whole, rtol=1e-5, atol=1e-7)
