"""``batch.max_tokens_per_micro_batch: auto`` (model/token_budget.py; configs/user_job.yaml's default).

The derived budget is never below a call's longest row (no sequence is refused), and the gradient does not
depend on the split: a train step under ``auto`` (one micro-batch on this batch) gives the same loss, gradient
norm and updated weights as the count-based split into one row per micro-batch (6 micro-batches). Single
process, CPU, ~3 s. A scaling bug (the schedule's 1 / num_microbatches not undone, model/scaling.py) makes the
count-based step differ and fails the comparison (checked by hand when the test was written).
"""

from __future__ import annotations

import pytest
import torch
from tests.test_trainer_skip import MODEL, rollouts

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.microbatch import AUTO_TOKEN_BUDGET
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.model import token_budget
from megatron_rl.trainer import Trainer

BATCH = ["batch.train_batch_size=2", "batch.policy_mini_batch_size=2", "batch.update_epochs_per_batch=1",
         "optimizer.optimizer=sgd", "optimizer.lr=0.5", "optimizer.lr_warmup_steps=0"]
COUNTED = ["batch.micro_batch_size=1"]
AUTO = ["batch.micro_batch_size=null", "batch.max_tokens_per_micro_batch=auto"]


def test_auto_is_never_below_the_longest_row_and_bad_words_are_refused():
    assert token_budget.resolve(AUTO_TOKEN_BUDGET, 64, [10, 300, 7]) == 300
    assert token_budget.resolve(AUTO_TOKEN_BUDGET, 64, [10, 30]) == 64
    assert token_budget.resolve(128, None, [10, 300]) == 128  # a number stays a hard cap
    assert load_config(None, AUTO).batch.max_tokens_per_micro_batch == AUTO_TOKEN_BUDGET
    with pytest.raises(ConfigError, match=r"batch.max_tokens_per_micro_batch='many' is out of range; .* or 'auto'"):
        load_config(None, ["batch.micro_batch_size=null", "batch.max_tokens_per_micro_batch=many"])


def test_user_job_default_is_auto():
    from pathlib import Path

    from megatron_rl.config_files import read_yaml

    batch = read_yaml(Path(__file__).parents[2] / "configs" / "user_job.yaml")["batch"]
    assert batch["max_tokens_per_micro_batch"] == AUTO_TOKEN_BUDGET and batch["micro_batch_size"] is None


def test_derived_default_gives_the_gradient_of_the_counted_split():
    from megatron_rl.model.policy import MegatronPolicy

    configs = [load_config(None, [*MODEL, *BATCH, *rule]) for rule in (COUNTED, AUTO)]
    groups = initialize_distributed(configs[0].parallel, seed=7)
    try:
        policies = [MegatronPolicy(c, groups, pad_token_id=0, total_optim_steps=4) for c in configs]
        policies[1].load_full_state_dict(policies[0].full_state_dict())
        assert policies[0].auto_token_budget is None
        assert policies[1].auto_token_budget >= 1024  # the tiny model: thousands of tokens, by memory
        trainers = [Trainer(c, p, skip_old_logprobs=True) for c, p in zip(configs, policies)]
        batch = trainers[0].to_training_batch(trainers[0].validate_and_merge(rollouts(), {}))
        assert [len(p.plan_call(batch).plan) for p in policies] == [6, 1]
        counted, auto = (t.train_step(rollouts()) for t in trainers)
        for name in ("policy/loss", "policy/pg_loss", "optim/grad_norm"):
            assert auto[name] == pytest.approx(counted[name], rel=1e-5), name
        weights = [p.full_state_dict() for p in policies]
        for name, weight in weights[0].items():
            torch.testing.assert_close(weights[1][name], weight, rtol=0, atol=1e-6, msg=name)
    finally:
        destroy_distributed()
