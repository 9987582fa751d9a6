"""Train one GRPO step, export the policy as a Hugging Face checkpoint, reload it with ``transformers``.

    .venv/bin/python examples/export_hf.py [--hf-dir /models/my-qwen3] [--out-dir /models/my-finetune]

Prints how far the weights moved from the source checkpoint and the parity of the reloaded model with the
policy (max |diff| of response log-probs). Export is collective: every rank calls it, rank 0 writes
``model.safetensors`` plus the source's config and tokenizer files.
"""

from pathlib import Path

from common import example_rollouts, hf_logprobs, parse_args, print0, setup_policy
from safetensors.torch import load_file

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.distributed.bootstrap import destroy_distributed
from megatron_rl.hf import export_policy_to_hf, load_tokenizer
from megatron_rl.trainer import Trainer

args = parse_args(__doc__, out_dir=True)
groups, policy = setup_policy(args, "batch.train_batch_size=2", "batch.policy_mini_batch_size=2", "optimizer.lr=1e-3")
rollouts = example_rollouts(load_tokenizer(args.hf_dir))
Trainer(policy.config, policy).train_step(rollouts)  # the weights move away from the source checkpoint
export_policy_to_hf(policy, args.out_dir)  # collective; rank 0 writes

batch = TrainingBatch.from_generator_output(rollouts, policy.pad_token_id)
ours = policy.forward(batch)["logprobs"]  # [B, R]
if groups.rank == 0:
    source, exported = load_file(Path(args.hf_dir) / "model.safetensors"), load_file(Path(args.out_dir) / "model.safetensors")
    moved = max((exported[name] - tensor).abs().max().item() for name, tensor in source.items())
    theirs = hf_logprobs(args.out_dir, batch["sequences"], batch["attention_mask"], ours.shape[1])  # [B, R]
    response = batch["response_mask"].bool()
    print0(f"exported {len(exported)} tensors to {args.out_dir}: max |weight change| from the source {moved:.3g}; "
           f"reloaded with transformers, max |logprob diff| vs the policy {(ours - theirs)[response].abs().max():.3g}")
destroy_distributed()
