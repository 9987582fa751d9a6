"""The main job: a complete RL loop on the toy multi-turn game, launched by ``run_megatron.sh`` through torchrun.

Place in the data flow: the outermost loop. Each RL step, on every rank with the same seeds::

    play the next-digit game with the current policy (demo/rollout.py, demo/sampler.py)  -> GeneratorOutput
    Trainer.train_step (megatron_rl/trainer.py)                                           -> metrics
    rank 0: progress bar, metrics.jsonl, TensorBoard (demo/reporting.py); every rank: checkpoint when due

At the end (rank 0): ``reward_loss.png`` and ``summary.txt`` in ``logging.output_dir``. Rollouts of step ``k``
depend only on ``(seed, k)`` and the weights, so a run resumed from the checkpoint of step ``k`` continues exactly
as the uninterrupted run would have. Ctrl-C keeps the last complete checkpoint (saves are atomic); running the
same command again resumes from it.

    python -m megatron_rl.main --config configs/demo_cpu.yaml [section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import MegatronRLConfig, dump_config, load_config
from megatron_rl.demo.environment import NextDigitGame
from megatron_rl.demo.policy_sampling import policy_next_token_logprobs
from megatron_rl.demo.reporting import RunReporter
from megatron_rl.demo.rollout import episodes_to_generator_output, mean_reward, play_episodes
from megatron_rl.demo.sampler import NextTokenLogprobs, SamplingParams, sampling_generator, uniform_next_token_logprobs
from megatron_rl.demo.tokenizer import DigitTokenizer
from megatron_rl.metrics import Metric

if TYPE_CHECKING:  # type hints only: these modules (and megatron-core) are imported where the job starts
    from megatron_rl.distributed.bootstrap import ParallelGroups
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="megatron_rl main job (RL on the toy multi-turn game)")
    parser.add_argument("--config", default="configs/demo_cpu.yaml", help="YAML of config overrides")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-3 demo.num_steps=20")
    return parser.parse_args(argv)


@dataclass
class Job:
    """Everything the loop needs, built once."""

    config: MegatronRLConfig
    groups: ParallelGroups
    tokenizer: DigitTokenizer
    game: NextDigitGame
    sampling: SamplingParams
    policy: MegatronPolicy
    trainer: Trainer
    save_dir: Path
    is_rank0: bool


# megatron-core announces at import, once per module and rank, that it falls back from TransformerEngine/Apex
# (expected on CPU; the README says TE/Apex are optional) and that a cuda-graph default is deprecated (we use no
# cuda graphs). Silenced so the job's own output stays readable; every other warning is kept.
_EXPECTED_MEGATRON_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def silence_expected_megatron_warnings() -> None:
    for prefix in _EXPECTED_MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix, category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    silence_expected_megatron_warnings()
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(args.config, args.overrides, world_size=world_size)
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    groups = initialize_distributed(config.parallel, config.seed)
    try:
        return run(build_job(config, groups))
    finally:
        destroy_distributed()


def build_job(config: MegatronRLConfig, groups: ParallelGroups) -> Job:
    """Tokenizer, game, policy (+ reference for KL), trainer; config checks first."""
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    tokenizer = DigitTokenizer()
    check_demo_config(config, tokenizer)
    demo, batch = config.demo, config.batch
    optim_steps_per_rl_step = batch.train_batch_size // batch.policy_mini_batch_size * batch.update_epochs_per_batch
    policy = MegatronPolicy(config, groups, pad_token_id=tokenizer.pad_token_id,
                            total_optim_steps=demo.num_steps * optim_steps_per_rl_step)
    reference = None
    if config.algorithm.use_kl_loss or config.algorithm.use_kl_in_reward:
        reference = MegatronPolicy(config, groups, role="reference", pad_token_id=tokenizer.pad_token_id)
        reference.load_full_state_dict(policy.full_state_dict())  # the reference is the initial policy
    trainer = Trainer(config, policy,
                      reference=reference)
    output_dir = Path(config.logging.output_dir)
    return Job(
        config=config,
        groups=groups,
        tokenizer=tokenizer,
        game=NextDigitGame(tokenizer, num_turns=demo.num_turns, offset=demo.digit_offset),
        sampling=SamplingParams(max_new_tokens=demo.max_new_tokens, temperature=demo.temperature,
                                stop_token_id=tokenizer.eos_token_id),
        policy=policy,
        trainer=trainer,
        save_dir=Path(config.checkpoint.save_dir) if config.checkpoint.save_dir else output_dir / "checkpoints",
        is_rank0=groups.rank == 0,
    )


def check_demo_config(config: MegatronRLConfig, tokenizer: DigitTokenizer) -> None:
    """The demo's own rules (ValueError naming the key and the fix)."""
    if config.model.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} but the demo tokenizer has {tokenizer.vocab_size} tokens; "
            f"set model.vocab_size={tokenizer.vocab_size} (configs/demo_cpu.yaml does)"
        )
    if config.model.hf_path is not None:
        raise ValueError(f"model.hf_path={config.model.hf_path!r}: the demo trains a model from scratch on its own "
                         "16-token vocabulary; unset model.hf_path")
    if config.demo.num_steps < 1:
        raise ValueError(f"demo.num_steps={config.demo.num_steps} must be >= 1")


def run(job: Job) -> int:
    """Resume if possible, then RL steps until ``demo.num_steps``; returns the process exit code."""
    config = job.config
    start_step = resume(job)
    reporter = open_reporter(job, start_step)
    baseline = random_baseline(job) if job.is_rank0 else 0.0
    next_token_logprobs = policy_next_token_logprobs(job.policy, job.tokenizer.pad_token_id)
    started, step = time.time(), start_step
    try:
        for step in range(start_step + 1, config.demo.num_steps + 1):
            metrics = rl_step(job, next_token_logprobs, step)
            if reporter is not None:
                reporter.log_step(step, metrics)
            if checkpoint_due(config, step):
                save(job, step)
    except KeyboardInterrupt:  # saves are atomic: an interrupted save leaves the previous checkpoint as latest
        if reporter is not None:
            reporter.close()
            print(f"\ninterrupted during step {step}; the last complete checkpoint in {job.save_dir} is kept. "
                  "Run the same command again to resume from it.", file=sys.stderr)
        return 130
    if reporter is not None:
        summary = reporter.finish(baseline=baseline, wall_time_s=time.time() - started)
        print(f"\n{summary}\nOutputs: {reporter.output_dir} (metrics.jsonl, tensorboard/, reward_loss.png, "
              f"summary.txt); checkpoints: {job.save_dir}", flush=True)
    return 0


def rl_step(job: Job, next_token_logprobs: NextTokenLogprobs, step: int) -> dict[str, float]:
    """Rollouts with the current policy, then one train step. Same on every rank (seeded by (seed, step))."""
    config = job.config
    started = time.perf_counter()
    played = play_episodes(
        job.game, next_token_logprobs, job.sampling,
        num_prompts=config.batch.train_batch_size,
        n_samples_per_prompt=config.batch.n_samples_per_prompt,
        rng=random.Random(config.seed * 1_000_003 + step),
        generator=sampling_generator(config.seed, step),
    )
    check_ranks_agree(job.groups, played)
    rollout_s = time.perf_counter() - started
    rollouts = episodes_to_generator_output(played, step_wise=config.stepwise.step_wise_trajectories)
    metrics = job.trainer.train_step(rollouts)
    metrics["timing/rollout_s"] = rollout_s
    metrics["timing/step_s"] = time.perf_counter() - started
    return metrics


def check_ranks_agree(groups: ParallelGroups, played: list) -> None:
    """Every rank must have sampled the same tokens, else each would train on different data (silently)."""
    from megatron_rl.distributed.metrics import reduce_metrics

    checksum = zlib.crc32(json.dumps([p.episode.responses for p in played]).encode())
    probe = {"max": Metric(checksum, 1.0, "max"), "min": Metric(checksum, 1.0, "min")}
    for name in ("dp_group", "tp_group", "pp_group"):
        agreed = reduce_metrics(probe, getattr(groups, name))
        if agreed["max"].value != agreed["min"].value:
            raise RuntimeError(f"ranks of the {name} sampled different rollouts (checksums {agreed['min'].value} "
                               f"vs {agreed['max'].value}): sampling must be identical on every rank")


def random_baseline(job: Job) -> float:
    """Mean reward of a uniformly random policy over ``demo.baseline_episodes`` games (no model involved)."""
    episodes = max(1, job.config.demo.baseline_episodes)
    played = play_episodes(job.game, uniform_next_token_logprobs(job.tokenizer.vocab_size), job.sampling,
                           num_prompts=episodes, n_samples_per_prompt=1, rng=random.Random(job.config.seed),
                           generator=sampling_generator(job.config.seed, -1))
    return mean_reward(played)


def open_reporter(job: Job, start_step: int) -> RunReporter | None:
    if not job.is_rank0:
        return None
    config = job.config
    output_dir = Path(config.logging.output_dir)
    dump_config(config, output_dir / "config.yaml")
    print(f"megatron_rl main job: {job.groups.world_size} rank(s) (TP{job.groups.tp_size} PP{job.groups.pp_size} "
          f"DP{job.groups.dp_size}); outputs in {output_dir.resolve()}, checkpoints in {job.save_dir.resolve()}"
          + (f"; resuming after step {start_step}" if start_step else ""), flush=True)
    return RunReporter(output_dir, total_steps=config.demo.num_steps, start_step=start_step,
                       tensorboard=config.logging.tensorboard,
                       progress_bar=config.logging.progress_bar, log_interval=config.logging.log_interval)


# --------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------

def checkpoint_due(config: MegatronRLConfig, step: int) -> bool:
    """Every ``checkpoint.save_interval`` steps (0 = never in between) and always after the last step."""
    interval = config.checkpoint.save_interval
    return step == config.demo.num_steps or (interval > 0 and step % interval == 0)


def save(job: Job, step: int) -> None:
    """Atomic distributed checkpoint of the policy (model, optimizer, LR schedule, RNG) and the loop state."""
    from megatron_rl.checkpoint import save_checkpoint

    save_checkpoint(job.policy, job.save_dir, {"step": step, "optimizer_steps": job.trainer.optimizer_steps})


def resume(job: Job) -> int:
    """Load the latest complete checkpoint of ``save_dir`` if ``checkpoint.resume``; returns its step (or 0)."""
    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.checkpoint.layout import complete_checkpoints

    if not job.config.checkpoint.resume or not complete_checkpoints(job.save_dir):
        return 0
    state = load_checkpoint(job.policy, job.save_dir)
    job.trainer.optimizer_steps = int(state.get("optimizer_steps", 0))
    return int(state["step"])


if __name__ == "__main__":
    sys.exit(main())
