"""One full PPO step with a critic (Trainer.train_step: policy + critic) against a plain-torch loop reference.

The policy is the bigram model of ``tests/test_trainer.py``; the critic is a "bigram value" model (the value of a
state is ``w[last token]``), behind a stand-in with MegatronCritic's face (``forward`` -> ``{"values"}``,
``forward_backward``, ``optim_step``). The rollouts are demo games in the trajectory layout: one sequence per
episode with observation tokens (loss mask 0) between the turns, so GAE must skip holes. The reference
recomputes the whole step with per-episode loops over action tokens: GAE (rewards credited, observations
skipped), whitening, per mini-batch token-mean PPO clip with SGD, then per critic mini-batch the token-mean
clipped value loss with SGD (its own mini-batch size, epochs and learning rate).
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from tests.test_trainer import TOK, V, Bigram, BigramPolicy, play, seq_logprobs

from megatron_rl.config import AlgorithmConfig, BatchConfig, ConfigError, CriticConfig, MegatronRLConfig, StepWiseConfig
from megatron_rl.environments.next_digit.rollout import episodes_to_generator_output, observation_after
from megatron_rl.trainer import Trainer

GAMMA, LAMBD, VALUE_CLIP = 0.9, 0.8, 0.05
POLICY_LR, CRITIC_LR = 0.5, 0.3


class BigramValue(torch.nn.Module):
    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


class BigramCritic(BigramPolicy):
    """MegatronCritic's face on ``BigramValue``: column k is V(state before response token k) = w[token S-R+k-1]."""

    def _logprobs(self, batch):  # the values play the log-probs' part in BigramPolicy.forward_backward
        seq, width = batch["sequences"], batch["response_mask"].shape[1]
        return self.model.w[seq[:, -width - 1:-1]]

    def forward(self, batch, *, compute_entropy=False):
        with torch.no_grad():
            return {"values": self._logprobs(batch).float()}

    def optim_step(self):
        grad = self.model.w.grad
        with torch.no_grad():
            self.model.w -= self.lr * grad
        self.model.w.grad = None
        return {"grad_norm": float(grad.norm()), "lr": self.lr}


def make_config(**critic) -> MegatronRLConfig:
    return MegatronRLConfig(
        algorithm=AlgorithmConfig(advantage_estimator="gae", gamma=GAMMA, lambd=LAMBD, value_clip=VALUE_CLIP),
        batch=BatchConfig(train_batch_size=4, policy_mini_batch_size=2, update_epochs_per_batch=2),
        critic=CriticConfig(lr=CRITIC_LR, **critic),
    )


# ---------------------------------------------------------------------------------------------------------------
# The loop reference
# ---------------------------------------------------------------------------------------------------------------

def episode_tokens(p):
    """(prompt, response, action flags) of an episode in the trajectory layout."""
    response, actions = [], []
    for t, turn in enumerate(p.episode.responses):
        obs = observation_after(p.episode, t)
        response += turn + obs
        actions += [True] * len(turn) + [False] * len(obs)
    return p.episode.prompts[0], response, actions


def state_values(w, prompt, response):
    tokens = prompt + response
    return torch.stack([w[tokens[j - 1]] for j in range(len(prompt), len(tokens))])


def reference_step(policy_model, value_model, played, cfg):
    episodes = [episode_tokens(p) for p in played]
    with torch.no_grad():
        old_logp = [seq_logprobs(policy_model.table, pr, rs) for pr, rs, _ in episodes]
        old_v = [state_values(value_model.w, pr, rs) for pr, rs, _ in episodes]
    advantages, returns = [], []
    for (pr, rs, act), v, p in zip(episodes, old_v, played):
        idx = [k for k, a in enumerate(act) if a]
        adv, last = {}, 0.0
        for n in reversed(range(len(idx))):
            k = idx[n]
            reward = p.episode.reward if n == len(idx) - 1 else 0.0  # the last column is an action token
            next_v = float(v[idx[n + 1]]) if n + 1 < len(idx) else 0.0
            last = reward + GAMMA * next_v - float(v[k]) + GAMMA * LAMBD * last
            adv[k] = last
        advantages.append(adv)
        returns.append({k: a + float(v[k]) for k, a in adv.items()})
    flat = [a for adv in advantages for a in adv.values()]
    mean, std = statistics.mean(flat), math.sqrt(statistics.variance(flat) + 1e-8)
    advantages = [{k: (a - mean) / std for k, a in adv.items()} for adv in advantages]

    def mini_batches(size, epochs):
        uids = sorted({p.uid for p in played})
        for _ in range(epochs):
            for s in range(0, len(uids), size):
                yield [i for i, p in enumerate(played) if p.uid in uids[s:s + size]]

    eps = cfg.algorithm.eps_clip_low
    for rows in mini_batches(cfg.batch.policy_mini_batch_size, cfg.batch.update_epochs_per_batch):
        tokens = sum(len(advantages[i]) for i in rows)
        loss = 0.0
        for i in rows:
            pr, rs, _ = episodes[i]
            ratio = torch.exp(seq_logprobs(policy_model.table, pr, rs) - old_logp[i])
            for k, a in advantages[i].items():
                loss = loss + torch.maximum(-a * ratio[k], -a * ratio[k].clamp(1 - eps, 1 + eps))
        (loss / tokens).backward()
        with torch.no_grad():
            policy_model.table -= POLICY_LR * policy_model.table.grad
        policy_model.table.grad = None
    critic = cfg.critic
    for rows in mini_batches(critic.mini_batch_size, critic.update_epochs_per_batch):
        tokens = sum(len(returns[i]) for i in rows)
        loss = 0.0
        for i in rows:
            v = state_values(value_model.w, *episodes[i][:2])
            for k, g in returns[i].items():
                clipped = old_v[i][k] + (v[k] - old_v[i][k]).clamp(-VALUE_CLIP, VALUE_CLIP)
                loss = loss + 0.5 * torch.maximum((v[k] - g) ** 2, (clipped - g) ** 2)
        (loss / tokens).backward()
        with torch.no_grad():
            value_model.w -= CRITIC_LR * value_model.w.grad
        value_model.w.grad = None


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_size", [1, 3])
def test_ppo_step_with_critic_matches_loop_reference(dp_size):
    played = play(Bigram(seed=1), turns=3)
    assert len({p.episode.reward for p in played}) > 1, "degenerate rollouts: all rewards equal"
    cfg = make_config(mini_batch_size=1, update_epochs_per_batch=3)  # not the policy's 2 prompts x 2 epochs
    policy_model, value_model = Bigram(seed=2), BigramValue()
    ref_policy, ref_value = copy.deepcopy(policy_model), copy.deepcopy(value_model)
    policy = BigramPolicy(policy_model, POLICY_LR, dp_size)
    critic = BigramCritic(value_model, CRITIC_LR, dp_size)
    metrics = Trainer(cfg, policy, critic=critic).train_step(episodes_to_generator_output(played, step_wise=False))
    reference_step(ref_policy, ref_value, played, cfg)

    torch.testing.assert_close(policy_model.table, ref_policy.table, atol=1e-6, rtol=1e-6)  # float32 values/adv
    torch.testing.assert_close(value_model.w, ref_value.w, atol=1e-6, rtol=1e-6)
    assert (value_model.w != BigramValue().w).any(), "the critic did not move"
    assert len(critic.calls) == 4 * 3 and metrics["critic/optim/steps"] == 12  # 4 prompts x 1 x 3 epochs
    for name in ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                 "critic/returns_mean", "critic/optim/grad_norm"):
        assert math.isfinite(metrics[name]), name


def test_bad_input_raises_value_error():
    cfg = make_config()
    policy = BigramPolicy(Bigram(), POLICY_LR)
    with pytest.raises(ValueError, match="critic=MegatronCritic"):  # GAE without a critic
        Trainer(cfg, policy)
    with pytest.raises(ConfigError, match="critic.lr is not set"):  # the critic's config missing
        MegatronRLConfig(algorithm=AlgorithmConfig(advantage_estimator="gae"))
    with pytest.raises(ConfigError, match="critic.enabled=false"):
        MegatronRLConfig(algorithm=AlgorithmConfig(advantage_estimator="gae"), critic=CriticConfig(enabled=False))
    with pytest.raises(ConfigError, match="critic.mini_batch_size=3"):
        make_config(mini_batch_size=3)
    with pytest.raises(ConfigError, match="temporal"):  # GAE with step-wise trajectories
        MegatronRLConfig(algorithm=AlgorithmConfig(advantage_estimator="gae"), critic=CriticConfig(lr=1e-3),
                         stepwise=StepWiseConfig(step_wise_trajectories=True))
    with pytest.raises(ValueError, match="config runs none"):
        Trainer(MegatronRLConfig(), policy, critic=BigramCritic(BigramValue(), CRITIC_LR))


def test_critic_loss_without_values_in_the_batch():
    """The value loss names the missing key (MegatronCritic runs it on every rank before the schedule)."""
    from megatron_rl.algorithms.losses import LossContext, value_loss_fn

    mask = torch.ones(2, 3)
    ctx = LossContext.for_minibatch(make_config().algorithm, mask)
    with pytest.raises(ValueError, match="'values'"):
        value_loss_fn(torch.zeros(2, 3), None, {"loss_mask": mask, "returns": mask}, ctx)
    with pytest.raises(ValueError, match="'returns'"):
        value_loss_fn(torch.zeros(2, 3), None, {"loss_mask": mask, "values": mask}, ctx)
