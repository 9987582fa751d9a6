"""Per-token log-probs of ``MegatronPolicy.forward`` against ``transformers`` on the same rows.

    .venv/bin/python examples/logprobs_vs_hf.py [--hf-dir /models/my-qwen3]

Rollouts become a ``TrainingBatch`` (left-padded ``sequences [B, S]``, right-aligned ``[B, R]`` response
tensors, docs/DESIGN.md section 2); ``forward`` returns ``logprobs [B, R]`` where column k is
``log p(sequences[:, S-R+k] | sequences[:, :S-R+k])``. Columns left of a row's response window hold the
log-probs of its last prompt tokens (0 only where the row has no earlier token); mask with ``response_mask``.
"""

from common import example_rollouts, hf_logprobs, parse_args, print0, setup_policy

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.distributed.bootstrap import destroy_distributed
from megatron_rl.hf import load_tokenizer

args = parse_args(__doc__)
groups, policy = setup_policy(args)
rollouts = example_rollouts(load_tokenizer(args.hf_dir))
batch = TrainingBatch.from_generator_output(rollouts, policy.pad_token_id)
ours = policy.forward(batch)["logprobs"]  # [B, R], on the host, the same on every rank

width = ours.shape[1]
theirs = hf_logprobs(args.hf_dir, batch["sequences"], batch["attention_mask"], width)  # [B, R], same layout
has_earlier_token = batch["attention_mask"][:, -width - 1 : -1].bool()  # the predicted token has a real token before it
assert (ours[~has_earlier_token] == 0).all(), "forward's columns without an earlier token are 0"

response = batch["response_mask"].bool()
print0(f"max |diff| vs transformers: response tokens {(ours - theirs)[response].abs().max():.3g}, "
       f"every column with a value (prompt tokens too) {(ours - theirs)[has_earlier_token].abs().max():.3g}")
destroy_distributed()
