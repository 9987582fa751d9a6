"""GRPO with vLLM rollouts: the engine samples, the trainer trains, the new weights stream into the engine.

    bash scripts/setup_engine.sh                                   # once: vLLM in its own venv (.venv-engine)
    .venv/bin/python examples/grpo_vllm.py                         # a tiny random Qwen3 (head size 32)
    .venv/bin/python examples/grpo_vllm.py --hf-dir /models/my-qwen3 --steps 20

The task: answer "what is two plus two ?" with "four" (reward 1 for a response that contains it). Each step
prints the mean reward and how far the engine's log-probs of its own samples are from the trainer's
recomputation (``rollout/logprob_abs_diff_max``: ~1e-6 in fp32 when every sync landed).
"""

from common import parse_args, print0, setup_policy

from megatron_rl.distributed.bootstrap import destroy_distributed
from megatron_rl.hf import load_tokenizer
from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.engine import SamplingSpec
from megatron_rl.inference.vllm.engine import VLLMEngine
from megatron_rl.trainer import Trainer


def main() -> None:
    parser_doc = __doc__
    args = parse_args(parser_doc, head_dim=32)
    groups, policy = setup_policy(args, "batch.train_batch_size=2", "batch.policy_mini_batch_size=2",
                                  "optimizer.lr=3e-3", "optimizer.lr_warmup_steps=0", "parallel.device=cpu")
    tokenizer = load_tokenizer(args.hf_dir)
    trainer = Trainer(policy.config, policy)
    # the engine starts from an HF export of the policy's current weights, in its own process and venv
    engine = VLLMEngine.start(policy, RolloutConfig(engine="vllm"), hf_dir=args.hf_dir, work_dir="outputs/grpo_vllm")
    spec = SamplingSpec(max_tokens=4, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    prompt = tokenizer("what is two plus two ?", add_special_tokens=False)["input_ids"]
    target = tokenizer("four", add_special_tokens=False)["input_ids"][0]
    n = 8  # samples per prompt (one GRPO group per prompt)
    try:
        for step in range(8):
            prompts = [prompt] * (2 * n)  # two groups of the same prompt
            completions = engine.generate(prompts, spec, seed=step)  # identical on every rank
            rewards = [float(target in c.token_ids) for c in completions]
            metrics = trainer.train_step({
                "prompt_token_ids": prompts,
                "response_ids": [c.token_ids for c in completions],
                "rewards": rewards,
                "loss_masks": [[1] * len(c.token_ids) for c in completions],
                "uids": [i // n for i in range(len(prompts))],
                "rollout_logprobs": [c.logprobs for c in completions],  # the engine's, checked by the trainer
            })
            sync_s = engine.update_weights(policy)  # in place: HF-named buckets over a gloo group
            print0(f"step {step}: reward {sum(rewards) / len(rewards):.3f}  engine-vs-trainer logprob max |diff| "
                   f"{metrics['rollout/logprob_abs_diff_max']:.2e}  weight sync {sync_s:.3f} s")
    finally:
        engine.close()
        destroy_distributed()


if __name__ == "__main__":
    main()
