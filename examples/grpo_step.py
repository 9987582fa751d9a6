"""One GRPO step on a model loaded from a local Hugging Face folder, from hand-written rollouts.

    .venv/bin/python examples/grpo_step.py                       # a tiny random Qwen3, made in a temp dir
    .venv/bin/python examples/grpo_step.py --hf-dir /models/my-qwen3

The same step with tensor parallelism over 2 processes (torchrun sets RANK / WORLD_SIZE / MASTER_ADDR for
every process; each runs this whole script and passes the same rollouts):

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/grpo_step.py --tp 2
"""

from common import example_rollouts, parse_args, print0, setup_policy

from megatron_rl.distributed.bootstrap import destroy_distributed
from megatron_rl.hf import load_tokenizer
from megatron_rl.trainer import Trainer

args = parse_args(__doc__)
groups, policy = setup_policy(
    args,
    "batch.train_batch_size=2",  # prompts per train_step
    "batch.policy_mini_batch_size=2",  # prompts per optimizer step
    "optimizer.lr=1e-4",
)
trainer = Trainer(policy.config, policy)  # policy.config: the config with the model section of config.json

generator_output = example_rollouts(load_tokenizer(args.hf_dir))  # plain lists; the same on every rank
metrics = trainer.train_step(generator_output)
print0(f"tp={groups.tp_size} dp={groups.dp_size}: " + ", ".join(
    f"{name}={metrics[name]:.6g}" for name in ("reward/mean", "policy/loss", "optim/grad_norm", "optim/lr")
))  # fmt: skip
destroy_distributed()
