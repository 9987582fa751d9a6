"""One GRPO step on a model loaded from a local Hugging Face folder, from hand-written rollouts.

    .venv/bin/python examples/grpo_step.py                       # a tiny random Qwen3, made in a temp dir
    .venv/bin/python examples/grpo_step.py --hf-dir /models/my-qwen3

The same step with tensor parallelism over 2 processes (torchrun sets RANK / WORLD_SIZE / MASTER_ADDR for
every process; each runs this whole script):

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/grpo_step.py --tp 2
"""

import os

from common import example_rollouts, parse_args, print0

from megatron_rl.config import load_config
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.hf import load_tokenizer, policy_from_hf
from megatron_rl.trainer import Trainer

args = parse_args(__doc__)
world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; a plain `python` run is 1 process
cfg = load_config(None, [  # defaults <- a YAML file (here none) <- dotted overrides; checked against world_size
    f"parallel.tensor_model_parallel_size={args.tp}",
    "batch.train_batch_size=2",         # prompts per train_step
    "batch.policy_mini_batch_size=2",   # prompts per optimizer step
    "batch.n_samples_per_prompt=2",     # GRPO group size
    "optimizer.lr=1e-4",
], world_size=world_size)  # fmt: skip
groups = initialize_distributed(cfg.parallel, cfg.seed)  # process group + megatron groups: groups.tp_group, dp_size...
policy = policy_from_hf(cfg, groups, hf_dir=args.hf_dir)  # shapes, pad id (policy.pad_token_id), weights
trainer = Trainer(policy.config, policy)  # policy.config: cfg with the model section read from config.json

generator_output = example_rollouts(load_tokenizer(args.hf_dir))  # plain lists; the same on every rank
metrics = trainer.train_step(generator_output)
print0(f"tp={groups.tp_size} dp={groups.dp_size}: " + ", ".join(
    f"{name}={metrics[name]:.6g}" for name in ("reward/mean", "policy/loss", "optim/grad_norm", "optim/lr")
))  # fmt: skip
destroy_distributed()
