"""The main job: a complete RL loop on the toy multi-turn game, launched by ``run_megatron.sh`` through torchrun.

Place in the data flow: the outermost loop, an application of the library (nothing in ``megatron_rl`` outside
``demo/`` imports it). Each RL step, on every rank with the same seeds::

    play the next-digit game with the current policy (demo/rollout.py, demo/sampler.py)  -> GeneratorOutput
    Trainer.train_step (megatron_rl/trainer.py)                                           -> metrics
    rank 0: progress bar, metrics.jsonl, TensorBoard (demo/reporting.py); every rank: checkpoint when due

At the end (rank 0): ``reward_loss.png`` and ``summary.txt`` in ``logging.output_dir``. Rollouts of step ``k``
depend only on ``(seed, k)`` and the weights, so a run resumed from the checkpoint of step ``k`` continues exactly
as the uninterrupted run would have. Ctrl-C keeps the last complete checkpoint (saves are atomic); running the
same command again resumes from it; running it again after the last step prints one line (the step the run
finished at, and what to change) and rewrites nothing.

    python -m megatron_rl.demo.main --config configs/demo_cpu.yaml [section.key=value ...]

A configuration mistake (``ConfigError``: a bad key or value, a world size the parallel sizes do not divide) is
printed once, by rank 0, without a traceback, and every rank exits with code 2. So is a resume that finds no
checkpoint that verifies (a ``ValueError`` naming each one; a damaged newest one alone is skipped with a
warning, see ``megatron_rl/checkpoint/dist.py``) and a save that hits a full or read-only disk (one line naming
the directory and the intact previous checkpoint; exit code 1). Under ``run_megatron.sh`` the launcher prints
that line instead of torchrun's failure report (``megatron_rl/distributed/launch.py``). Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import ConfigError, MegatronRLConfig
from megatron_rl.demo.config import DemoConfig, DemoJobConfig, dump_demo_config, load_demo_config
from megatron_rl.demo.environment import NextDigitGame
from megatron_rl.demo.policy_sampling import policy_next_token_logprobs
from megatron_rl.demo.reporting import RunReporter
from megatron_rl.demo.rollout import episodes_to_generator_output, mean_reward, play_episodes
from megatron_rl.demo.sampler import NextTokenLogprobs, SamplingParams, sampling_generator, uniform_next_token_logprobs
from megatron_rl.demo.tokenizer import DigitTokenizer
from megatron_rl.metrics import Metric

if TYPE_CHECKING:  # type hints only: these modules (and megatron-core) are imported where the job starts
    from megatron_rl.distributed.bootstrap import ParallelGroups
    from megatron_rl.model.critic import MegatronCritic
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

    config: DemoJobConfig
    groups: ParallelGroups
    tokenizer: DigitTokenizer
    game: NextDigitGame
    sampling: SamplingParams
    policy: MegatronPolicy
    critic: MegatronCritic | None
    """The value model (PPO with a critic: ``algorithm.advantage_estimator: gae``), else None."""
    trainer: Trainer
    save_dir: Path
    is_rank0: bool


# megatron-core announces at import, once per module and rank, that it falls back from TransformerEngine/Apex
# (expected on CPU; the README says TE/Apex are optional) and that a cuda-graph default is deprecated (we use no
# cuda graphs). Silenced so the job's own output stays readable; every other warning is kept.
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    try:
        config = load_demo_config(args.config, args.overrides)
        groups = initialize_distributed(config.rl.parallel, config.rl.seed)  # checks the world size first
    except ConfigError as err:
        return report_config_error(err)
    try:
        return run(build_job(config, groups))
    except CheckpointProblem as err:
        return report_error(str(err), kind="checkpoint error", code=err.code)
    finally:
        destroy_distributed()


def report_config_error(err: ConfigError) -> int:
    """Rank 0 prints the mistake (one line, no traceback); every rank exits with 2 (usage error)."""
    return report_error(str(err), kind="config error", code=2)


def report_error(message: str, *, kind: str, code: int) -> int:
    """``message`` shown once (no traceback: every rank raised the same error; under ``run_megatron.sh`` the
    launcher prints it instead of torchrun's failure report, ``megatron_rl/distributed/launch.py``); returns
    ``code``."""
    from megatron_rl.distributed.launch import report_error as report

    return report(f"megatron_rl: {kind}: {message}", code=code)


class CheckpointProblem(Exception):
    """A resume or save failed for a reason that is the user's or the storage's (not a bug); the same message
    on every rank. ``code``: the exit code (2 bad checkpoints, 1 storage)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def build_job(config: DemoJobConfig, groups: ParallelGroups) -> Job:
    """Tokenizer, game, policy (+ reference for KL), trainer (the config was validated when it was loaded)."""
    from megatron_rl.model.critic import MegatronCritic
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer

    tokenizer = DigitTokenizer()
    rl, demo, batch = config.rl, config.demo, config.rl.batch
    optim_steps_per_rl_step = batch.train_batch_size // batch.policy_mini_batch_size * batch.update_epochs_per_batch
    policy = MegatronPolicy(rl, groups, pad_token_id=tokenizer.pad_token_id,
                            total_optim_steps=demo.num_steps * optim_steps_per_rl_step)
    reference = None
    if rl.algorithm.use_kl_loss or rl.algorithm.use_kl_in_reward:
        reference = MegatronPolicy(rl, groups, role="reference", pad_token_id=tokenizer.pad_token_id)
        reference.load_full_state_dict(policy.full_state_dict())  # the reference is the initial policy
    critic = None
    if rl.critic.active(rl.algorithm):
        critic_cfg = rl.critic
        size, epochs = critic_cfg.updates(batch)
        critic_steps = batch.train_batch_size // size * epochs
        critic = MegatronCritic(rl, groups, pad_token_id=tokenizer.pad_token_id,
                                total_optim_steps=demo.num_steps * critic_steps)
        if critic_cfg.init_from_policy:
            critic.load_trunk(policy.full_state_dict())
    trainer = Trainer(rl, policy,
                      reference=reference, critic=critic)
    output_dir = Path(rl.logging.output_dir)
    return Job(
        config=config,
        groups=groups,
        tokenizer=tokenizer,
        game=NextDigitGame(tokenizer, num_turns=demo.num_turns, offset=demo.digit_offset),
        sampling=SamplingParams(max_new_tokens=demo.max_new_tokens, temperature=demo.temperature,
                                stop_token_id=tokenizer.eos_token_id),
        policy=policy,
        critic=critic,
        trainer=trainer,
        save_dir=Path(rl.checkpoint.save_dir) if rl.checkpoint.save_dir else output_dir / "checkpoints",
        is_rank0=groups.rank == 0,
    )


def run(job: Job) -> int:
    """Resume if possible, then RL steps until ``demo.num_steps``; returns the process exit code."""
    config = job.config
    start_step = resume(job)
    if start_step >= config.demo.num_steps:
        return report_finished(job, start_step)
    reporter = open_reporter(job, start_step)
    baseline = random_baseline(job) if job.is_rank0 else 0.0
    next_token_logprobs = policy_next_token_logprobs(job.policy, job.tokenizer.pad_token_id)
    started, step = time.time(), start_step
    try:
        for step in range(start_step + 1, config.demo.num_steps + 1):
            metrics = rl_step(job, next_token_logprobs, step)
            if reporter is not None:
                reporter.log_step(step, metrics)
            if checkpoint_due(config.rl, config.demo, step):
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


def report_finished(job: Job, step: int) -> int:
    """The run in ``save_dir`` already reached ``demo.num_steps``: one line on rank 0 saying so and what to
    change; exit code 0 (the state the command asks for holds, as for ``make`` on a built target). Nothing in
    the output directory is rewritten: its config.yaml and summary.txt keep describing the run that happened."""
    if job.is_rank0:
        demo, output_dir = job.config.demo, job.config.rl.logging.output_dir
        print(f"megatron_rl: the run in {job.save_dir} finished at step {step} (demo.num_steps={demo.num_steps}); "
              f"nothing to do, nothing rewritten. To train on, raise demo.num_steps (e.g. demo.num_steps="
              f"{step + demo.num_steps}); for a new run, set a new logging.output_dir (now {output_dir})",
              flush=True)
    return 0


def rl_step(job: Job, next_token_logprobs: NextTokenLogprobs, step: int) -> dict[str, float]:
    """Rollouts with the current policy, then one train step. Same on every rank (seeded by (seed, step))."""
    rl, demo = job.config.rl, job.config.demo
    started = time.perf_counter()
    played = play_episodes(
        job.game, next_token_logprobs, job.sampling,
        num_prompts=rl.batch.train_batch_size,
        n_samples_per_prompt=demo.n_samples_per_prompt,
        rng=random.Random(rl.seed * 1_000_003 + step),
        generator=sampling_generator(rl.seed, step),
    )
    check_ranks_agree(job.groups, played)
    rollout_s = time.perf_counter() - started
    rollouts = episodes_to_generator_output(played, step_wise=rl.stepwise.step_wise_trajectories)
    metrics = job.trainer.train_step(rollouts)
    metrics["timing/rollout_s"] = rollout_s
    metrics["timing/step_s"] = time.perf_counter() - started
    return metrics


def check_ranks_agree(groups: ParallelGroups, played: list) -> None:
    """Every rank must have sampled the same tokens, else each would train on different data (silently)."""
    from megatron_rl.distributed.metrics import reduce_metrics

    checksum = zlib.crc32(json.dumps([p.episode.responses for p in played]).encode())
    probe = {"max": Metric(checksum, 1.0, "max"), "min": Metric(checksum, 1.0, "min")}
    for name in ("dp_group", "tp_group", "pp_group", "cp_group"):
        agreed = reduce_metrics(probe, getattr(groups, name))
        if agreed["max"].value != agreed["min"].value:
            raise RuntimeError(f"ranks of the {name} sampled different rollouts (checksums {agreed['min'].value} "
                               f"vs {agreed['max'].value}): sampling must be identical on every rank")


def random_baseline(job: Job) -> float:
    """Mean reward of a uniformly random policy over ``demo.baseline_episodes`` games (no model involved)."""
    episodes = max(1, job.config.demo.baseline_episodes)
    played = play_episodes(job.game, uniform_next_token_logprobs(job.tokenizer.vocab_size), job.sampling,
                           num_prompts=episodes, n_samples_per_prompt=1, rng=random.Random(job.config.rl.seed),
                           generator=sampling_generator(job.config.rl.seed, -1))
    return mean_reward(played)


def open_reporter(job: Job, start_step: int) -> RunReporter | None:
    if not job.is_rank0:
        return None
    config, logging = job.config, job.config.rl.logging
    output_dir = Path(logging.output_dir)
    dump_demo_config(config, output_dir / "config.yaml")
    g = job.groups
    layout = f"TP{g.tp_size} PP{g.pp_size} DP{g.dp_size}" + (f" CP{g.cp_size}" if g.cp_size > 1 else "")
    print(f"megatron_rl main job: {g.world_size} rank(s) ({layout}); outputs in {output_dir.resolve()}, "
          f"checkpoints in {job.save_dir.resolve()}" + (f"; resuming after step {start_step}" if start_step else ""),
          flush=True)
    return RunReporter(output_dir, total_steps=config.demo.num_steps, start_step=start_step,
                       tensorboard=logging.tensorboard, progress_bar=logging.progress_bar,
                       log_interval=logging.log_interval)


# --------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------

def checkpoint_due(rl: MegatronRLConfig, demo: DemoConfig, step: int) -> bool:
    """Every ``checkpoint.save_interval`` steps (0 = never in between) and always after the last step."""
    interval = rl.checkpoint.save_interval
    return step == demo.num_steps or (interval > 0 and step % interval == 0)


def save(job: Job, step: int) -> None:
    """Atomic distributed checkpoint of the policy (model, optimizer, LR schedule, RNG) and the loop state; the
    critic's (model, optimizer, LR schedule) in ``save_dir/critic`` first (``checkpoint/critic.py``)."""
    from megatron_rl.checkpoint import save_with_critic
    from megatron_rl.checkpoint.dist import STORAGE_ERRNOS

    try:
        save_with_critic(job.policy, job.critic, job.save_dir,
                         {"step": step, "optimizer_steps": job.trainer.optimizer_steps})
    except RuntimeError as err:
        if isinstance(err.__cause__, OSError) and err.__cause__.errno in STORAGE_ERRNOS:
            raise CheckpointProblem(str(err), code=1) from err
        raise


def resume(job: Job) -> int:
    """Load the newest checkpoint of ``save_dir`` that verifies if ``checkpoint.resume``; returns its step (or 0).

    Any ``step_*`` directory means "resume": when none of them verifies, the job stops (exit code 2) instead
    of starting over and truncating the history in ``metrics.jsonl``.
    """
    from megatron_rl.checkpoint import load_with_critic
    from megatron_rl.checkpoint.layout import checkpoint_dirs

    if not job.config.rl.checkpoint.resume or not checkpoint_dirs(job.save_dir):
        return 0
    try:
        state = load_with_critic(job.policy, job.critic, job.save_dir)
    except ValueError as err:
        raise CheckpointProblem(str(err), code=2) from err
    job.trainer.optimizer_steps = int(state.get("optimizer_steps", 0))
    return int(state["step"])


if __name__ == "__main__":
    sys.exit(main())
