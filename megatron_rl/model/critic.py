"""The value model of PPO with a critic: the policy's GPT trunk with a scalar head (docs/DESIGN.md section 13).

Place in the data flow (docs/DESIGN.md section 1): beside the policy. The Trainer asks it for the values of the
rollouts before any update (``forward``), then trains it on the GAE returns (``forward_backward`` with
``algorithms.losses.value_loss_fn``, then ``optim_step``). Everything else is the policy's machinery, reused
as is: ``MegatronCritic`` is a ``MegatronPolicy`` (plan/packing, PP schedule, the scaling contract of
``model/scaling.py``, DDP, optimizer, LR schedule, ``full_state_dict``, and ``checkpoint.save_checkpoint``)
whose last stage's output layer is ``ValueHead``:

    trunk (TP/PP, same spec as the policy)  -> final norm -> hidden [s, 1, h]   ([s/tp, 1, h] under SP)
    ValueHead                               -> (SP: all-gather the sequence)  -> Linear(h, 1) -> [s, 1, 1]
    GPTModel                                -> [1, T, 1]; schedule.values_head -> unpack_response -> [b, R]

The head is replicated on every TP rank (one output, nothing to shard): each TP rank computes every value,
like the vocab-parallel log-probs after their all-reduces. Its gradient is therefore complete on each TP rank,
and the gradient it sends into the trunk is too: under sequence parallelism the all-gather is taken with
``tensor_parallel_output_grad=False`` (backward = split, not reduce-scatter, which would sum ``tp`` full copies).
The head's parameters carry no ``tensor_model_parallel`` attribute, so megatron counts them once in the
gradient norm and ``model/weights.py`` treats them as replicated.

Values come back ``[B, R]`` right-aligned with the log-probs' convention: column k of row i is
``V(sequences[i, :S-R+k])``, the value of the state before token ``sequences[i, S-R+k]`` is generated (computed
at the position of the token before it, exactly where the log-prob of that token is).

The output layer is untied (``share_embeddings_and_output_weights`` is forced off in the critic's config): a
scalar head cannot share the embedding. The GPTModel is built with its vocabulary output layer, which is then
replaced (one transient ``[V/tp, h]`` allocation per build), so the trunk is exactly the policy's spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_rl.config import MegatronRLConfig
from megatron_rl.data.batch import TrainingBatch
from megatron_rl.distributed.bootstrap import ParallelGroups
from megatron_rl.model import schedule
from megatron_rl.model.builder import build_gpt_model
from megatron_rl.model.optimizer import follow_new_weights
from megatron_rl.model.policy import MegatronPolicy
from megatron_rl.model.weights import load_full_state_dict

HEAD_PREFIX = "output_layer."
"""State-dict prefix of the value head (the GPTModel attribute it replaces); everything else is the trunk."""

HEAD_SEED_OFFSET = 7919
"""The head's init draws from ``torch.Generator().manual_seed(seed + HEAD_SEED_OFFSET)``: the same weights on
every rank and layout (TP ranks must hold identical replicas), independent of megatron's RNG trackers."""


class ValueHead(torch.nn.Module):
    """``hidden [s, b, h] -> values [s, b, 1]`` (fp32 weights in the model's dtype), replicated over TP.

    Called by GPTModel in place of its output layer: ``head(hidden, weight=None, runtime_gather_output=None)``
    returns ``(values, None)`` like a megatron linear layer.
    """

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, tp_group: Any, dtype: torch.dtype,
                 init_std: float, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed + HEAD_SEED_OFFSET)
        self.weight = torch.nn.Parameter(
            (torch.randn(1, hidden_size, generator=generator) * init_std).to(dtype))  # [1, h]
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None, **_: Any) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward splits (replicated compute, module doc)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def critic_config(config: MegatronRLConfig) -> MegatronRLConfig:
    """The config the critic's model and optimizer are built from: the run's, with an untied output layer and
    the critic's learning rate (``critic.lr``; ``optimizer.min_lr`` capped at it)."""
    if config.critic.lr is None:
        raise ValueError("critic.lr is not set; the critic needs its own learning rate (e.g. critic.lr=1e-3)")
    lr = config.critic.lr
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, share_embeddings_and_output_weights=False),
        optimizer=dataclasses.replace(config.optimizer, lr=lr, min_lr=min(config.optimizer.min_lr, lr)),
    )


def build_value_model(config: MegatronRLConfig, groups: ParallelGroups) -> torch.nn.Module:
    """This rank's GPTModel stage with ``ValueHead`` as the output layer on the last stage."""
    module = build_gpt_model(config.model, config.parallel, groups)
    if groups.is_last_stage:
        module.output_layer = ValueHead(
            config.model.hidden_size, sequence_parallel=config.parallel.sequence_parallel,
            tp_group=groups.tp_group, dtype=module.config.params_dtype, init_std=config.model.init_method_std,
            seed=config.seed,
        ).to(groups.device)
    return module


class MegatronCritic(MegatronPolicy):
    """A value model with the policy's machinery (module docstring); ``forward`` returns ``{"values": [B, R]}``.

    ``config`` is the run's config (the critic derives its own: ``critic_config``). ``forward_backward`` takes a
    loss ``loss_fn(values [b, R], None, mb, ctx)`` such as ``algorithms.losses.value_loss_fn``.
    """

    def __init__(self, config: MegatronRLConfig, groups: ParallelGroups, *, pad_token_id: int = 0,
                 total_optim_steps: int | None = None) -> None:
        super().__init__(critic_config(config), groups, role="critic", pad_token_id=pad_token_id,
                         total_optim_steps=total_optim_steps)

    def build_module(self) -> torch.nn.Module:
        return build_value_model(self.config, self.groups)

    def forward(self, batch: TrainingBatch, *, compute_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Values ``{"values": [B, R]}`` fp32 on the host, identical on every rank (column convention: module
        docstring; columns where the row has no earlier token are 0). ``compute_entropy`` must be False."""
        if compute_entropy:
            raise ValueError("a critic has no entropy; call forward(batch) without compute_entropy")
        return self._forward_rows(batch, partial(schedule.values_head, groups=self.groups), ["values"])

    def next_token_logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise ValueError("a critic has no next-token distribution; sample with the policy")

    def _loss_head(self, loss_fn: schedule.LossFn, loss_config: Any, compute_entropy: bool,
                   num_microbatches: int, logits_term: schedule.LogitsTerm | None = None) -> schedule.Head:
        if compute_entropy or logits_term is not None:
            raise ValueError("a critic has no entropy or logits; call forward_backward without compute_entropy "
                             "and logits_term")
        return partial(schedule.value_loss_head, groups=self.groups, loss_fn=loss_fn, loss_config=loss_config,
                       num_microbatches=num_microbatches)

    def load_trunk(self, full_sd: Mapping[str, torch.Tensor]) -> None:
        """Load a policy's single-process state dict (``MegatronPolicy.full_state_dict()``, e.g. from an HF
        checkpoint) into the trunk; the value head keeps its own weights. The optimizer follows."""
        own_head = {k: v for k, v in self.full_state_dict().items() if k.startswith(HEAD_PREFIX)}
        trunk = {k: v for k, v in full_sd.items() if not k.startswith(HEAD_PREFIX)}
        load_full_state_dict(self.module, {**trunk, **own_head}, self.groups)
        follow_new_weights(self.optimizer)
