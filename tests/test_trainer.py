"""Trainer.train_step against a loop reference, with a plain-torch single-process policy (no Megatron).

The policy here is a bigram language model (``logits = E[previous token]``) trained with SGD, so its update from
one train step can be recomputed by an obvious per-sequence loop: group baselines by uid, per-mini-batch token
mean, PPO clip with the old log-probs of the pre-update model, one SGD step per mini-batch. The rollouts come
from the demo game, step-wise (several turns per trajectory), so merging and prompt-based mini-batches are
exercised too.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import pytest
import torch

from megatron_rl.algorithms.losses import LossContext
from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.environments.next_digit.game import NextDigitGame
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, play_episodes
from megatron_rl.inference.builtin_engine import SamplingParams
from megatron_rl.inference.builtin_engine import BuiltinEngine, rollout_seed
from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer
from megatron_rl.metrics import merge_metrics
from megatron_rl.trainer import Trainer

TOK = DigitTokenizer()
V = TOK.vocab_size


class Bigram(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=gen, dtype=torch.float64))

    def next_token_logprobs(self, contexts) -> torch.Tensor:
        last = torch.tensor([c[-1] for c in contexts])
        return torch.log_softmax(self.table[last], dim=-1)


@dataclass
class Call:
    rows: int
    loss_tokens: float


class BigramPolicy:
    """Single-process stand-in for MegatronPolicy: global batch in, global results out; simulated DP shards."""

    def __init__(self, model: Bigram, lr: float, dp_size: int = 1) -> None:
        self.model, self.lr, self.dp_size = model, lr, dp_size
        self.pad_token_id = TOK.pad_token_id
        self.calls: list[Call] = []

    def _logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        seq = batch["sequences"]  # [B, S]
        R = batch["response_mask"].shape[1]
        logp = torch.log_softmax(self.model.table[seq[:, :-1]], dim=-1)  # [B, S-1, V]
        token_logprobs = logp.gather(-1, seq[:, 1:, None])[..., 0]  # [B, S-1]
        return token_logprobs[:, -R:]  # docs/DESIGN.md section 2

    def forward(self, batch: TrainingBatch, *, compute_entropy: bool = False) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {"logprobs": self._logprobs(batch).float()}

    def forward_backward(self, batch, loss_fn, loss_config, *, compute_entropy=False):
        batch, _ = batch.pad_to_multiple(self.dp_size, self.pad_token_id)  # as MegatronPolicy: it owns DP padding
        assert len(batch) % self.dp_size == 0, (len(batch), self.dp_size)
        self.calls.append(Call(len(batch), float(batch["loss_mask"].sum())))
        logprobs = self._logprobs(batch)
        shard = len(batch) // self.dp_size
        parts = []
        for r in range(self.dp_size):  # each DP rank's rows, losses summed (the scaling contract's result)
            rows = slice(r * shard, (r + 1) * shard)
            mb = {k: v[rows] for k, v in batch.tensors.items()}
            loss, metrics = loss_fn(logprobs[rows], None, mb, loss_config)
            loss.backward(retain_graph=True)
            parts.append(metrics)
        return merge_metrics(*parts)

    def optim_step(self) -> dict[str, float]:
        grad = self.model.table.grad
        norm = float(grad.norm())
        with torch.no_grad():
            self.model.table -= self.lr * grad
        self.model.table.grad = None
        return {"grad_norm": norm, "lr": self.lr}


def make_config(*, merge: bool, step_wise: bool = True, epochs: int = 2) -> MegatronRLConfig:
    cfg = MegatronRLConfig()
    cfg.batch.train_batch_size, cfg.batch.policy_mini_batch_size = 4, 2
    cfg.batch.update_epochs_per_batch = epochs
    cfg.stepwise.step_wise_trajectories, cfg.stepwise.merge_stepwise_output = step_wise, merge
    return cfg


def play(model: Bigram, num_prompts: int = 4, n: int = 3, turns: int = 2, seed: int = 0):
    game = NextDigitGame(TOK, num_turns=turns)
    params = SamplingParams(max_new_tokens=3, stop_token_id=TOK.eos_token_id)
    return play_episodes(game, BuiltinEngine(model.next_token_logprobs), params.to_spec(), num_prompts=num_prompts,
                         n_samples_per_prompt=n, rng=random.Random(seed), seed=rollout_seed(seed, 0))


# ---------------------------------------------------------------------------------------------------------------
# The loop reference
# ---------------------------------------------------------------------------------------------------------------

def seq_logprobs(table: torch.Tensor, prompt: list[int], response: list[int]) -> torch.Tensor:
    tokens = prompt + response
    logp = [torch.log_softmax(table[tokens[j - 1]], -1)[tokens[j]] for j in range(len(prompt), len(tokens))]
    return torch.stack(logp)


def reference_train_step(model: Bigram, played, cfg: MegatronRLConfig, lr: float) -> None:
    """GRPO (group by game, unbiased std) on episode rewards, every turn's tokens get the episode advantage;
    per mini-batch of prompts: token-mean PPO clip loss, one SGD step."""
    eps_clip = cfg.algorithm.eps_clip_low
    rewards = torch.tensor([p.episode.reward for p in played], dtype=torch.float64)
    adv = torch.zeros_like(rewards)
    for uid in {p.uid for p in played}:
        idx = [i for i, p in enumerate(played) if p.uid == uid]
        g = rewards[idx]
        adv[idx] = (g - g.mean()) / (g.std() + 1e-6)
    turns = [(i, p.episode.prompts[t], p.episode.responses[t]) for i, p in enumerate(played)
             for t in range(len(p.episode.responses))]
    with torch.no_grad():
        old = [seq_logprobs(model.table, pr, rs) for _, pr, rs in turns]
    prompts_per_mb = cfg.batch.policy_mini_batch_size
    uids = sorted({p.uid for p in played})
    for _ in range(cfg.batch.update_epochs_per_batch):
        for k in range(0, len(uids), prompts_per_mb):
            chosen = [j for j, (i, _, _) in enumerate(turns) if played[i].uid in uids[k:k + prompts_per_mb]]
            num_tokens = sum(len(turns[j][2]) for j in chosen)
            loss = 0.0
            for j in chosen:
                i, prompt, response = turns[j]
                ratio = torch.exp(seq_logprobs(model.table, prompt, response) - old[j])
                a = adv[i]
                loss = loss + torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_clip, 1 + eps_clip)).sum()
            (loss / num_tokens).backward()
            with torch.no_grad():
                model.table -= lr * model.table.grad
            model.table.grad = None


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("merge, dp_size", [(False, 1), (True, 1), (False, 3), (True, 2)])
def test_train_step_matches_loop_reference(merge: bool, dp_size: int) -> None:
    lr = 0.5
    sampler_model = Bigram(seed=1)
    played = play(sampler_model)
    assert len({p.episode.reward for p in played}) > 1, "degenerate rollouts: all rewards equal"

    ref_model = Bigram(seed=2)
    model = copy.deepcopy(ref_model)
    cfg = make_config(merge=merge)
    policy = BigramPolicy(model, lr, dp_size)
    trainer = Trainer(cfg, policy)
    metrics = trainer.train_step(episodes_to_generator_output(played, step_wise=True))
    reference_train_step(ref_model, played, cfg, lr)

    assert torch.allclose(model.table, ref_model.table, atol=1e-5, rtol=1e-5), \
        (model.table - ref_model.table).abs().max()
    assert trainer.optimizer_steps == 4 and metrics["optim/steps"] == 4  # 4 prompts / 2 per mini-batch x 2 epochs
    assert all(call.rows % dp_size == 0 for call in policy.calls)
    expected_reward = sum(p.episode.reward for p in played) / len(played)
    assert metrics["reward/mean"] == pytest.approx(expected_reward, abs=1e-6)
    assert metrics["batch/num_trajectories"] == len(played)
    if merge:
        assert metrics["stepwise/num_seq_before_merge"] == 2 * len(played)
        assert metrics["stepwise/num_seq_after_merge"] == len(played)


def test_trajectory_layout_trains_like_step_wise() -> None:
    """One sequence per episode (observations masked) gives the same update as the step-wise layout."""
    played = play(Bigram(seed=1))
    updated = []
    for step_wise in (True, False):
        model = Bigram(seed=2)
        trainer = Trainer(make_config(merge=False, step_wise=step_wise), BigramPolicy(model, 0.5))
        trainer.train_step(episodes_to_generator_output(played, step_wise=step_wise))
        updated.append(model.table.detach().clone())
    assert torch.allclose(updated[0], updated[1], atol=1e-6)


def test_rollout_logprob_mismatch_metrics() -> None:
    model = Bigram(seed=1)
    played = play(model)
    trainer = Trainer(make_config(merge=True, epochs=1), BigramPolicy(copy.deepcopy(model), lr=0.0))
    out = episodes_to_generator_output(played, step_wise=True)
    metrics = trainer.train_step(out)
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-5  # sampler and trainer agree on the same weights

    for name in ("ratio_mean", "ratio_min", "ratio_max"):  # with off_policy_correction 'none' too
        assert metrics[f"off_policy/{name}"] == pytest.approx(1.0, abs=1e-5)

    shifted = dict(out, rollout_logprobs=[[lp - 0.25 for lp in row] for row in out["rollout_logprobs"]])
    metrics = trainer.train_step(shifted)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(0.25, abs=1e-5)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-5)

    # token j of each row sampled with log-prob old - 0.2 j: ratios exp(0.2 j), statistics over all tokens
    shifts = [[0.2 * j for j in range(len(row))] for row in out["rollout_logprobs"]]
    staggered = dict(out, rollout_logprobs=[[lp - d for lp, d in zip(row, ds)]
                                            for row, ds in zip(out["rollout_logprobs"], shifts)])
    metrics = trainer.train_step(staggered)
    ratios = [math.exp(d) for ds in shifts for d in ds]
    assert metrics["off_policy/ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-4)
    assert metrics["off_policy/ratio_min"] == pytest.approx(min(ratios), rel=1e-4)
    assert metrics["off_policy/ratio_max"] == pytest.approx(max(ratios), rel=1e-4)


def test_optimizer_steps_independent_of_turns_and_merging() -> None:
    steps = set()
    for turns in (1, 3):
        for merge in (False, True):
            trainer = Trainer(make_config(merge=merge, epochs=3), BigramPolicy(Bigram(), lr=0.1))
            metrics = trainer.train_step(episodes_to_generator_output(play(Bigram(1), turns=turns), step_wise=True))
            steps.add((trainer.optimizer_steps, metrics["optim/steps"]))
    assert steps == {(6, 6.0)}


def test_loss_context_counts_rows_before_dp_padding() -> None:
    seen: list[LossContext] = []

    class Spy(BigramPolicy):
        def forward_backward(self, batch, loss_fn, loss_config, *, compute_entropy=False):
            seen.append(loss_config)
            return super().forward_backward(batch, loss_fn, loss_config)

    played = play(Bigram(1), num_prompts=2, n=1, turns=1)  # 2 rows; mini-batches of 1 prompt = 1 row
    cfg = make_config(merge=False, epochs=1)
    cfg.batch.train_batch_size, cfg.batch.policy_mini_batch_size = 2, 1
    policy = Spy(Bigram(), lr=0.1, dp_size=4)
    Trainer(cfg, policy).train_step(
        episodes_to_generator_output(played, step_wise=True))
    assert [c.rows for c in policy.calls] == [4, 4]  # padding larger than the mini-batch
    assert [ctx.minibatch_num_sequences for ctx in seen] == [1, 1]
    assert [ctx.minibatch_loss_tokens for ctx in seen] == [len(p.episode.responses[0]) for p in played]


def test_kl_needs_reference() -> None:
    cfg = make_config(merge=False)
    cfg.algorithm.use_kl_loss = True
    with pytest.raises(ValueError, match="reference"):
        Trainer(cfg, BigramPolicy(Bigram(), 0.1))


def test_metrics_are_finite_and_sum_metrics_average_over_steps() -> None:
    trainer = Trainer(make_config(merge=True), BigramPolicy(Bigram(), lr=0.1))
    metrics = trainer.train_step(episodes_to_generator_output(play(Bigram(1)), step_wise=True))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    for key in ("policy/loss", "policy/pg_loss", "policy/clipfrac", "optim/grad_norm", "optim/lr"):
        assert key in metrics
    assert metrics["optim/lr"] == pytest.approx(0.1)


def test_kl_in_reward_and_kl_loss_use_the_reference() -> None:
    played = play(Bigram(seed=1))
    policy_model, ref_model = Bigram(seed=2), Bigram(seed=3)
    turns = [(p.episode.prompts[t], p.episode.responses[t]) for p in played for t in range(len(p.episode.responses))]
    with torch.no_grad():  # k1 KL per token, before any update: log pi_old - log pi_ref
        k1 = torch.cat([seq_logprobs(policy_model.table, pr, rs) - seq_logprobs(ref_model.table, pr, rs)
                        for pr, rs in turns])
    # KL in the reward is rejected with step-wise training (earlier steps' KL would be dropped): one sequence
    # per episode instead, whose loss tokens are the same responses in the same contexts.
    cfg = make_config(merge=False, step_wise=False, epochs=1)
    cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_estimator_type = True, "k1"
    trainer = Trainer(cfg, BigramPolicy(copy.deepcopy(policy_model), 0.1),
                      reference=BigramPolicy(ref_model, 0.0))
    metrics = trainer.train_step(episodes_to_generator_output(played, step_wise=False))
    assert metrics["kl_in_reward/kl"] == pytest.approx(float(k1.mean()), abs=1e-5)

    cfg = make_config(merge=True, epochs=1)
    cfg.algorithm.use_kl_loss = True
    trainer = Trainer(cfg, BigramPolicy(copy.deepcopy(policy_model), 0.1),
                      reference=BigramPolicy(ref_model, 0.0))
    metrics = trainer.train_step(episodes_to_generator_output(played, step_wise=True))
    assert metrics["policy/kl"] > 0 and torch.isfinite(torch.tensor(metrics["policy/kl"]))


def test_configs_built_in_code_are_validated() -> None:
    cfg = make_config(merge=False, step_wise=False)
    cfg.stepwise.merge_stepwise_output = True  # without step-wise: load_config would reject it
    with pytest.raises(ValueError, match="stepwise.merge_stepwise_output"):
        Trainer(cfg, BigramPolicy(Bigram(seed=2), 0.1))


# ---------------------------------------------------------------------------------------------------------------
# The same train step with MegatronPolicy on CUDA and on CPU (docs/DESIGN.md section 11)
# ---------------------------------------------------------------------------------------------------------------

def _megatron_config(device: str) -> MegatronRLConfig:
    from megatron_rl.config import ModelConfig, OptimizerConfig, ParallelConfig

    cfg = make_config(merge=True)
    cfg.parallel = ParallelConfig(device=device)
    cfg.model = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, vocab_size=V, max_position_embeddings=64, attention_backend="local")
    cfg.optimizer = OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.0)  # linear in the gradient (see test)
    # the bigram sampled the rollouts, so old and rollout log-probs differ: the masked weights run on the device
    # (on CPU: half the 65 loss tokens masked; the nearest log-ratio is 0.005 nats from a band end, thousands of
    # times the CPU/GPU difference, so no token flips sides between the two runs)
    cfg.algorithm.off_policy_correction = "token_mask"
    return cfg


def _megatron_train_step_child(rank: int, world_size: int, device: str, rollouts, initial) -> dict:
    """One Trainer.train_step of a MegatronPolicy on ``device`` from the weights ``initial`` (None: its own)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact fp32 on CUDA
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    cfg = _megatron_config(device)
    groups = initialize_distributed(cfg.parallel, seed=5)
    policy = MegatronPolicy(cfg, groups, pad_token_id=TOK.pad_token_id)
    if initial is not None:
        policy.load_full_state_dict(initial)
    before = policy.full_state_dict()
    metrics = Trainer(cfg, policy).train_step(rollouts)
    return {"device": str(groups.device), "before": before, "metrics": metrics, "after": policy.full_state_dict()}


@pytest.mark.gpu
def test_megatron_train_step_on_cuda_equals_cpu() -> None:
    """Tolerance: fp32 with TF32 off rounds every operation the same way (2**-24 relative); only the summation
    order of cuBLAS vs the CPU BLAS and reductions differs, ~1e-7 relative per dot product of 64-128 terms, a few
    1e-6 after two layers, log-softmax and the loss. Metrics get rel 1e-4; SGD (the update is lr x gradient, no
    Adam normalization that amplifies near-zero gradients) keeps the weight differences at lr x 1e-6 << 1e-5."""
    from tests.support.multirank import run_ranks

    rollouts = episodes_to_generator_output(play(Bigram()), step_wise=True)
    assert "rollout_logprobs" in rollouts  # the mismatch metric that crashed on CUDA is computed
    cpu = run_ranks(1, _megatron_train_step_child, "cpu", rollouts, None, timeout=300)[0]
    gpu = run_ranks(1, _megatron_train_step_child, "cuda", rollouts, cpu["before"], timeout=300, cpu_only=False)[0]
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    assert gpu["metrics"].keys() == cpu["metrics"].keys()
    for name, value in cpu["metrics"].items():
        if not name.startswith("timing/"):
            assert gpu["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name, weight in cpu["after"].items():
        assert gpu["after"][name].device.type == "cpu"
        assert (gpu["after"][name] - weight).abs().max() < 1e-5, name
