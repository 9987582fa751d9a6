"""The RL step: rollouts in, optimizer steps out. The one module that knows the order of the stages.

Place in the data flow (docs/DESIGN.md section 1): everything between a ``GeneratorOutput`` and the optimizer::

    GeneratorOutput
      -> validate (the one validation of the rollouts) -> merge (step-wise, optional) -> TrainingBatch [B, S] / [B, R]
      -> old log-probs (policy) and reference log-probs (reference model), no grad      [B, R]
         (MoE routing replay R2: the policy also records its routing -> routed_experts [B, S, L, k], replayed
          by every forward_backward of the step; R3: the rollouts' routed_experts, replayed from here on)
      -> teachers' log-probs (on-policy distillation, optional: distillation/signal.py)   [B, R]
      -> old values (critic, PPO with a critic), no grad                               [B, R]
      -> token rewards (- KL, optional) -> advantages (step-wise aware; GAE over action tokens) -> whitening
         (+ the distillation term -coef * (logp_student - logp_teacher) per sampled token, optional;
          kind full_kl: none here, the update's loss gets the full-vocabulary KL, distillation/full_kl.py)
      -> for each epoch, for each prompt-based mini-batch:
             normalize advantages over the mini-batch's rows (loss_reduction)
             -> policy.forward_backward(policy_loss_fn) -> policy.optim_step()     (the policy pads for DP)
      -> critic (when there is one): for each critic epoch, for each critic mini-batch:
             critic.forward_backward(value_loss_fn) -> critic.optim_step()         (own reduction weights)
      -> metrics

PPO with a critic (docs/DESIGN.md section 13): the critic's updates read only the old values and the returns,
both fixed before any update, so running them after the policy's (with their own mini-batch size and epochs)
is the same math as interleaving them mini-batch by mini-batch. The value loss takes its reduction weights
from ``LossContext`` (``loss_reduction`` of the policy) and never touches the advantages, which carry the
policy's normalization: nothing is normalized twice.

The trainer itself is pure orchestration: it touches no Megatron internal and no ``torch.distributed``. The
policy (``megatron_rl.model.policy.MegatronPolicy``, or anything with the same ``forward`` /
``forward_backward`` / ``optim_step``) takes the *global* batch on every rank and returns global results, so
every rank runs ``train_step`` on the same rollouts and gets the same metrics. The policy owns what depends on
its layout: DP padding and ``pad_token_id`` (the trainer reads ``policy.pad_token_id``).

Device contract (docs/DESIGN.md section 11): the batch and everything computed here live on the host, whatever
the policy's device. A policy hands results back on the host; ``add_old_and_ref_logprobs`` still copies them
there (a no-op for a host tensor), so no stage below can mix devices (the first CUDA run crashed exactly there,
subtracting CUDA ``old_logprobs`` from host ``rollout_logprobs``).

Skipped forward (``Trainer.old_logprobs_needed``): when the step takes one optimizer step (one mini-batch, one
epoch) and nothing before the update reads the old log-probs (no KL in the reward, no MoE routing replay), the
policy cannot move between that forward and the update's, so the old log-probs ARE the update's (detached; the
loss takes them so when ``old_logprobs`` is absent, as TRL and verl do): the forward is skipped, the rollout
mismatch and ratio metrics come from the update's forward (``policy_loss_with_rollout_metrics``), and
``timing/old_logprobs_skipped`` is 1 (0 when the forward runs).

Metrics are ``Metric`` partials merged exactly (``megatron_rl.metrics``). Across the optimizer steps of one
train step, token/sequence means stay exact means over the whole batch; losses (``reduce="sum"`` within a
mini-batch, i.e. the mini-batch objective) become means over the optimizer steps.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from megatron_rl.algorithms.advantages import compute_advantages_and_returns
from megatron_rl.algorithms.kl import apply_kl_to_rewards
from megatron_rl.algorithms.losses import LossContext, policy_loss_fn, value_loss_fn
from megatron_rl.algorithms.normalization import normalize_minibatch_advantages, whiten_advantages
from megatron_rl.algorithms.off_policy import importance_ratio_metrics
from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.data.generator_output import GeneratorOutput, validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.data.minibatch import compute_prompt_mini_batch_boundaries
from megatron_rl.distillation.signal import Distillation
from megatron_rl.metrics import Metric, finalize_metrics, mean_metric, merge_metrics

Metrics = dict[str, Metric]


class PolicyLike(Protocol):
    """What the trainer needs of a policy (docs/INTERFACES.md, ``model/policy.py``).

    ``forward`` / ``forward_backward`` take any number of rows (the policy pads for data parallelism itself).
    """

    pad_token_id: int

    def forward(self, batch: TrainingBatch, *, compute_entropy: bool = False) -> dict[str, torch.Tensor]: ...

    def forward_backward(self, batch: TrainingBatch, loss_fn: Any, loss_config: Any, *,
                         compute_entropy: bool = False) -> Metrics: ...

    def optim_step(self) -> dict[str, float]: ...


class Trainer:
    """Runs RL steps on a policy (and an optional frozen reference model for KL).

    Sequences are padded with ``policy.pad_token_id``. ``train_step`` must be called with the same rollouts
    on every rank.
    """

    def __init__(self, config: MegatronRLConfig, policy: PolicyLike, *, reference: PolicyLike | None = None,
                 critic: PolicyLike | None = None, skip_old_logprobs: bool = True,
                 distillation: Distillation | None = None) -> None:
        config.validate()  # re-checks a config changed after construction (tests and library users mutate fields)
        algo = config.algorithm
        if (algo.use_kl_loss or algo.use_kl_in_reward) and reference is None:
            raise ValueError(
                "algorithm.use_kl_loss / use_kl_in_reward need a reference model: pass reference=MegatronPolicy("
                "config, groups, role='reference') to Trainer, or set both to false"
            )
        if config.critic.active(algo) and critic is None:
            raise ValueError(
                f"algorithm.advantage_estimator={algo.advantage_estimator!r} / critic.enabled need a critic: pass "
                "critic=MegatronCritic(config, groups) (megatron_rl.model.critic) to Trainer"
            )
        if critic is not None and not config.critic.active(algo):
            raise ValueError("Trainer got a critic but the config runs none; set critic.enabled=true (or "
                             "algorithm.advantage_estimator='gae'), or drop critic=")
        if config.distillation.enabled != (distillation is not None):
            raise ValueError("distillation.teachers and Trainer(distillation=...) go together: pass distillation="
                             "megatron_rl.distillation.teachers.build_distillation(config, groups, pad_id) exactly "
                             "when distillation.teachers is set")
        self.distillation = distillation
        self.config = config
        self.policy = policy
        self.reference = reference
        self.critic = critic
        self.optimizer_steps = 0
        """Optimizer steps taken by this trainer (all train steps)."""
        self.skip_old_logprobs = skip_old_logprobs
        """False: always run the old-log-prob forward (the main job passes False under rollout.max_staleness > 0)."""

    # ----------------------------------------------------------------------------------------------------------
    # The RL step
    # ----------------------------------------------------------------------------------------------------------

    def train_step(self, generator_output: GeneratorOutput) -> dict[str, float]:
        """One RL step on one batch of rollouts (identical on every rank); returns final metric values."""
        metrics: Metrics = {}
        with timed(metrics, "timing/prepare_s"):
            rollouts = self.validate_and_merge(generator_output, metrics)
            batch = self.to_training_batch(rollouts)  # [B, S] / [B, R]
        needed = self.old_logprobs_needed(batch)
        with timed(metrics, "timing/old_logprobs_s"):
            self.add_old_and_ref_logprobs(batch, policy=needed)  # old_logprobs (+ ref_logprobs) [B, R]
            metrics.update(self.replay_logprob_metrics(batch))
        metrics["timing/old_logprobs_skipped"] = Metric(0.0 if needed else 1.0, 1.0, "max")
        if self.distillation is not None:
            with timed(metrics, "timing/teacher_logprobs_s"):
                metrics.update(self.distillation.score(batch))  # teacher_logprobs/<name> [B, R]
        if self.critic is not None:
            with timed(metrics, "timing/old_values_s"):
                self.add_old_values(batch)  # values [B, R]
        metrics.update(rollout_metrics(batch))
        metrics.update(self.add_advantages(batch))  # advantages, returns [B, R]
        with timed(metrics, "timing/update_s"):
            metrics.update(self.update_policy(batch))
        if self.critic is not None:
            metrics.update(value_metrics(batch))
            with timed(metrics, "timing/critic_update_s"):
                metrics.update(self.update_critic(batch))
        return finalize_metrics(metrics)

    # ----------------------------------------------------------------------------------------------------------
    # Stages, in order
    # ----------------------------------------------------------------------------------------------------------

    @property
    def step_wise(self) -> bool:
        return self.config.stepwise.step_wise_trajectories

    def validate_and_merge(self, out: GeneratorOutput, metrics: Metrics) -> GeneratorOutput:
        """Check the rollouts (once, here: later stages get ``validated=True``); merge consecutive turns whose
        prompts extend each other (step-wise, optional)."""
        model = self.config.model
        routing = (model.num_layers, model.moe_router_topk, model.num_moe_experts) if model.num_moe_experts else None
        out = validate_generator_output(out, step_wise=self.step_wise, routing=routing)  # plain lists
        if model.moe_router_replay == "r3" and out.get("routed_experts") is None:
            raise ValueError("model.moe_router_replay='r3' replays the rollouts' routing, but GeneratorOutput has no "
                             "'routed_experts' (the built-in engine records them; vLLM's CPU build cannot return "
                             "them, enable_return_routed_experts): use moe_router_replay='r2' or an engine that does")
        if not (self.step_wise and self.config.stepwise.merge_stepwise_output):
            return out
        merged, counts = merge_stepwise_output(out, validated=True)
        metrics.update({f"stepwise/{name}": Metric(value, 1.0, "sum") for name, value in counts.items()})
        return merged

    def to_training_batch(self, out: GeneratorOutput) -> TrainingBatch:
        """The left-padded tensor block of docs/DESIGN.md section 2 (``out`` validated by ``validate_and_merge``)."""
        return TrainingBatch.from_generator_output(
            out, self.policy.pad_token_id, max_seq_len=self.config.algorithm.max_seq_len, step_wise=self.step_wise,
            validated=True,
        )

    def old_logprobs_needed(self, batch: TrainingBatch) -> bool:
        """Whether the old-log-prob forward can differ from the update's own (module docstring): several optimizer
        steps this step, a stage before the update that reads them (KL in the reward, MoE routing replay,
        distillation of rollouts without rollout log-probs), or
        ``skip_old_logprobs`` off."""
        cfg = self.config
        mini_batches = len(compute_prompt_mini_batch_boundaries(batch.uids, cfg.batch.policy_mini_batch_size))
        return (not self.skip_old_logprobs or mini_batches * cfg.batch.update_epochs_per_batch != 1
                or cfg.algorithm.use_kl_in_reward or cfg.model.moe_router_replay != "none"
                or (self.distillation is not None and self.distillation.needs_old_logprobs(batch)))

    @torch.no_grad()
    def add_old_and_ref_logprobs(self, batch: TrainingBatch, *, policy: bool = True) -> None:
        """``old_logprobs`` from the policy before any update (``policy=False``: skipped, see
        ``old_logprobs_needed``); ``ref_logprobs`` when a reference model exists.

        Routing replay (``model.moe_router_replay``): r2 records the routing of this forward into
        ``routed_experts``; r3 keeps the rollouts' (this forward already replays it); otherwise it is dropped."""
        replay = self.config.model.moe_router_replay
        if replay != "r3":
            batch.tensors.pop("routed_experts", None)
        if replay == "r2":
            out = self.policy.forward(batch, record_routing=True)
            batch["routed_experts"] = out["routed_experts"]
        elif policy:
            out = self.policy.forward(batch)
        if policy or replay == "r2":
            batch["old_logprobs"] = out["logprobs"].to("cpu", torch.float32)
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.forward(batch)["logprobs"].to("cpu", torch.float32)

    @torch.no_grad()
    def replay_logprob_metrics(self, batch: TrainingBatch) -> Metrics:
        """R3 with rollout log-probs: ``moe/replay_logprob_abs_diff_mean`` (rollout vs the old log-probs, which
        replay the rollout's routing) and ``moe/noreplay_logprob_abs_diff_mean`` (vs one extra forward that
        routes freely). Empty otherwise (R2 replays its own forward's routing: ``rollout/logprob_abs_diff_*``
        is already the mismatch without replay)."""
        if self.config.model.moe_router_replay != "r3" or "rollout_logprobs" not in batch:
            return {}
        free_batch = TrainingBatch({k: v for k, v in batch.tensors.items() if k != "routed_experts"}, batch.uids,
                                   batch.trajectory_ids, batch.is_last_step)
        free = self.policy.forward(free_batch)["logprobs"].to("cpu", torch.float32)
        metrics = {}
        for name, logprobs in (("replay", batch["old_logprobs"]), ("noreplay", free)):
            diff = logprob_mismatch_metrics(batch["rollout_logprobs"], logprobs, batch["loss_mask"])
            metrics[f"moe/{name}_logprob_abs_diff_mean"] = diff["rollout/logprob_abs_diff_mean"]
        return metrics

    @torch.no_grad()
    def add_old_values(self, batch: TrainingBatch) -> None:
        """``values`` from the critic before any update (column k: V of the state before response token k)."""
        batch["values"] = self.critic.forward(batch)["values"].to("cpu", torch.float32)

    def add_advantages(self, batch: TrainingBatch) -> Metrics:
        """Token rewards (minus the KL penalty when it goes into the reward) -> ``advantages``, ``returns``; plus the
        distillation term on the advantages when there are teachers (``distillation/signal.py``)."""
        algo = self.config.algorithm
        rewards, metrics = batch["rewards"], {}
        if algo.use_kl_in_reward:  # over loss tokens only: observation tokens were not sampled by the policy
            rewards, metrics = apply_kl_to_rewards(rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                                   batch["loss_mask"], algo.kl_loss_coef, algo.kl_estimator_type)
        # GAE runs over action tokens: observation tokens inside a response (loss mask 0) are skipped
        mask = batch["loss_mask"] if algo.advantage_estimator == "gae" else batch["response_mask"]
        advantages, returns = compute_advantages_and_returns(
            rewards, mask, batch.uids, algo.advantage_estimator, algo,
            values=batch["values"] if "values" in batch else None,
            is_last_step=batch.is_last_step if self.step_wise else None,
        )
        if algo.advantage_whitening:
            advantages = whiten_advantages(advantages, batch["loss_mask"])  # trained tokens, not observations
        if self.distillation is not None and self.distillation.in_advantages:  # after whitening: own units
            term, distill_metrics = self.distillation.advantage_term(batch)
            advantages = advantages + term
            metrics.update(distill_metrics)
        batch["advantages"], batch["returns"] = advantages, returns
        metrics["advantages/mean"] = mean_metric(advantages, batch["loss_mask"])
        metrics["advantages/abs_max"] = Metric(float(advantages.abs().max()), 1.0, "max")
        return metrics

    def update_policy(self, batch: TrainingBatch) -> Metrics:
        """``update_epochs_per_batch`` passes over the prompt-based mini-batches, one optimizer step each."""
        batch_cfg = self.config.batch
        boundaries = compute_prompt_mini_batch_boundaries(batch.uids, batch_cfg.policy_mini_batch_size)
        expected = batch_cfg.train_batch_size // batch_cfg.policy_mini_batch_size
        if len(boundaries) != expected:
            warnings.warn(
                f"the batch holds {len(boundaries) * batch_cfg.policy_mini_batch_size} prompts but "
                f"batch.train_batch_size={batch_cfg.train_batch_size}: this step takes {len(boundaries)} optimizer "
                f"steps per epoch instead of {expected} (the LR schedule counts on {expected})",
                stacklevel=2,
            )
        return over_mini_batches(batch, boundaries, batch_cfg.update_epochs_per_batch, self.train_mini_batch)

    def train_mini_batch(self, mini_batch: TrainingBatch) -> Metrics:
        """Normalize the advantages over this mini-batch's rows, accumulate gradients, step."""
        algo = self.config.algorithm
        mini_batch["advantages"] = normalize_minibatch_advantages(
            mini_batch["advantages"], mini_batch["loss_mask"], algo.loss_reduction, algo.max_seq_len
        )
        loss_context = LossContext.for_minibatch(algo, mini_batch["loss_mask"])  # the real rows (no DP padding)
        loss_fn = policy_loss_fn if "old_logprobs" in mini_batch else policy_loss_with_rollout_metrics
        term = self.distillation.loss_term(mini_batch) if self.distillation is not None else None
        extra = {} if term is None else {"logits_term": term}  # distillation's full_kl (distillation/full_kl.py)
        loss_metrics = self.policy.forward_backward(
            mini_batch, loss_fn, loss_context, compute_entropy=algo.entropy_loss_coef != 0.0, **extra
        )
        step_metrics = self.policy.optim_step()
        self.optimizer_steps += 1
        return {**per_optimizer_step(loss_metrics), **optimizer_metrics(step_metrics)}

    def update_critic(self, batch: TrainingBatch) -> Metrics:
        """``critic.update_epochs_per_batch`` passes over prompt-based critic mini-batches, one step each."""
        size, epochs = self.config.critic.updates(self.config.batch)
        boundaries = compute_prompt_mini_batch_boundaries(batch.uids, size)
        return over_mini_batches(batch, boundaries, epochs, self.train_critic_mini_batch)

    def train_critic_mini_batch(self, mini_batch: TrainingBatch) -> Metrics:
        """Clipped value loss on this mini-batch (its own reduction weights, from ``LossContext``), one step."""
        loss_context = LossContext.for_minibatch(self.config.algorithm, mini_batch["loss_mask"])
        loss_metrics = self.critic.forward_backward(mini_batch, value_loss_fn, loss_context)
        step_metrics = self.critic.optim_step()
        return {**per_optimizer_step(loss_metrics),
                **{f"critic/{k}": v for k, v in optimizer_metrics(step_metrics).items()}}


# --------------------------------------------------------------------------------------------------------------
# Metric helpers (pure)
# --------------------------------------------------------------------------------------------------------------

def rollout_metrics(batch: TrainingBatch) -> Metrics:
    """Reward, lengths and (when rollout log-probs are given) the rollout/old log-prob mismatch of a batch and
    its importance ratios ``off_policy/ratio_{mean,min,max}`` (``algorithms/off_policy.py``).

    ``reward/mean`` is the mean over trajectories of the last step's summed token rewards (where step-wise
    rewards sit; a non-step-wise row is its own last step), over the trajectories that are trained: a last step
    without any loss token (the placeholder of a group dropped for failed samples, ``environments/failures.py``)
    carries no reward. ``rollout/zero_advantage_groups``: the share of groups (uids with two or more trained
    trajectories) whose rewards are all equal: GRPO and RLOO give them zero advantage, no learning signal.
    """
    last = torch.tensor(batch.is_last_step, dtype=torch.bool)  # [B]
    trained = last & (batch["loss_mask"].sum(dim=-1) > 0)  # [B]
    rows = trained if bool(trained.any()) else last
    trajectory_rewards = batch["rewards"].sum(dim=-1)[rows]  # [num_trajectories]
    metrics = {
        "reward/mean": mean_metric(trajectory_rewards),
        "reward/max": Metric(float(trajectory_rewards.max()), 1.0, "max"),
        "reward/min": Metric(float(trajectory_rewards.min()), 1.0, "min"),
        "response_length/mean": mean_metric(batch["response_mask"].sum(dim=-1).float()),
        "batch/num_sequences": Metric(len(batch), 1.0, "sum"),
        "batch/num_trajectories": Metric(int(last.sum()), 1.0, "sum"),
        "batch/loss_tokens": Metric(batch["loss_mask"].sum(), 1.0, "sum"),
    }
    uids = [uid for uid, keep in zip(batch.uids, rows.tolist()) if keep]
    metrics.update(zero_advantage_metrics(trajectory_rewards, uids))
    if "rollout_logprobs" in batch and "old_logprobs" in batch:
        metrics.update(logprob_mismatch_metrics(batch["rollout_logprobs"], batch["old_logprobs"], batch["loss_mask"]))
        # whole batch, once per step: old and rollout are fixed before any update, whatever the correction mode
        metrics.update(importance_ratio_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"]))
    return metrics


def zero_advantage_metrics(rewards: torch.Tensor, uids: list) -> Metrics:
    """``rollout/zero_advantage_groups``: share of the groups of ``rewards [T]`` (one per trajectory, grouped by
    ``uids``) with two or more members whose rewards are all equal (to 1e-6); {} when no group has two."""
    groups: dict[Any, list[float]] = {}
    for uid, reward in zip(uids, rewards.tolist()):
        groups.setdefault(uid, []).append(reward)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return {}
    flat = sum(max(g) - min(g) <= 1e-6 * max(1.0, abs(max(g))) for g in sized)
    return {"rollout/zero_advantage_groups": Metric(float(flat), float(len(sized)), "mean")}


def over_mini_batches(batch: TrainingBatch, boundaries: list[tuple[int, int]], epochs: int,
                      train: Callable[[TrainingBatch], Metrics]) -> Metrics:
    """``train`` on each mini-batch ``[start, end)`` of ``batch``, ``epochs`` times over; merged metrics."""
    return merge_metrics(*(train(batch.slice(start, end)) for _ in range(epochs) for start, end in boundaries))


def value_metrics(batch: TrainingBatch) -> Metrics:
    """The critic's fit before this step's update, over loss tokens: means of the old values and the returns,
    and the explained variance ``1 - Var(G - V) / Var(G)`` (1 = perfect, 0 = no better than the mean)."""
    mask = batch["loss_mask"]
    values, returns = batch["values"], batch["returns"]
    valid = mask > 0
    g, residual = returns[valid], (returns - values)[valid]
    var_g = float(g.var(unbiased=False)) if g.numel() > 1 else 0.0
    var_r = float(residual.var(unbiased=False)) if g.numel() > 1 else 0.0
    return {
        "critic/values_mean": mean_metric(values, mask),
        "critic/returns_mean": mean_metric(returns, mask),
        "critic/explained_variance": Metric(1.0 - var_r / var_g if var_g > 0 else 0.0, 1.0, "mean"),
    }


def logprob_mismatch_metrics(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                             loss_mask: torch.Tensor) -> Metrics:
    """Mean and max of ``|rollout - old|`` over loss tokens (``[B, R]`` each): sampler vs trainer numerics.

    Partials on the device of ``old_logprobs``, no host sync (issue 53); the max counts the loss tokens (a part
    without any is empty, a batch without any reports 0)."""
    device = old_logprobs.device
    rollout_logprobs, old_logprobs, loss_mask = (x.to(device, torch.float32) for x in (rollout_logprobs,
                                                                                       old_logprobs, loss_mask))
    valid = loss_mask > 0
    diff = (rollout_logprobs - old_logprobs).abs()
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    largest = diff.max() if diff.numel() else diff.new_zeros(())
    return {
        "rollout/logprob_abs_diff_mean": mean_metric(diff, loss_mask),
        "rollout/logprob_abs_diff_max": Metric(largest, valid.sum(), "max"),
    }


def policy_loss_with_rollout_metrics(logprobs: torch.Tensor, entropy: torch.Tensor | None,
                                     mb: Mapping[str, torch.Tensor], loss_config: Any) -> tuple[torch.Tensor, Metrics]:
    """``policy_loss_fn`` with the old log-prob forward skipped (old = ``logprobs``, detached) plus what
    ``rollout_metrics`` computes from the old log-probs otherwise: the rollout mismatch and the importance ratio
    statistics, as partials of this micro-batch (one without loss tokens adds empty ones: count 0), merged
    exactly over micro-batches and DP ranks."""
    loss, metrics = policy_loss_fn(logprobs, entropy, mb, loss_config)
    if "rollout_logprobs" in mb:  # a micro-batch without loss tokens adds empty partials (no host sync)
        current, rollout = logprobs.detach().float(), mb["rollout_logprobs"]
        metrics.update(logprob_mismatch_metrics(rollout, current, mb["loss_mask"]))
        metrics.update(importance_ratio_metrics(current, rollout, mb["loss_mask"]))
    return loss, metrics


def per_optimizer_step(metrics: Mapping[str, Metric]) -> Metrics:
    """Turn one mini-batch's ``sum`` metrics (its objective) into one sample of a mean over optimizer steps."""
    return {
        name: Metric(m.final(), 1.0, "mean") if m.reduce == "sum" else m
        for name, m in metrics.items()
    }


def optimizer_metrics(step: Mapping[str, float]) -> Metrics:
    """``optim_step``'s floats (``grad_norm``, ``lr``): means over optimizer steps, the max grad norm, a count."""
    out: Metrics = {f"optim/{name}": Metric(float(value), 1.0, "mean") for name, value in step.items()}
    if "grad_norm" in step:
        out["optim/grad_norm_max"] = Metric(float(step["grad_norm"]), 1.0, "max")
    out["optim/steps"] = Metric(1.0, 1.0, "sum")
    return out


@contextmanager
def timed(metrics: Metrics, name: str) -> Iterator[None]:
    """Add the wall time of the block to ``metrics[name]`` (seconds, reduce="sum")."""
    start = time.perf_counter()
    yield
    metrics[name] = Metric(time.perf_counter() - start, 1.0, "sum")
