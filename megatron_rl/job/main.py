"""The main job: a complete RL loop on any environment, launched by ``run_megatron.sh`` through torchrun.

Place in the data flow: the outermost loop, an application of the library (nothing in ``megatron_rl`` outside
``job/`` imports it). Set-up: the environment (``megatron_rl/environments``: the digit game, or prompt files + a
reward function, checked before any process group exists), the policy (random, or ``model.hf_path``), the
rollout engine (``rollout.engine``: builtin, vllm or a registered one, ``inference/registry.py``). Each RL step,
on every rank with the same seeds::

    environment.rollout(engine, sampling spec, rollout seed of (seed, step))               -> GeneratorOutput
        (or taken from the batches generated ahead, rollout.max_staleness: job/pipeline.py)
    Trainer.train_step (megatron_rl/trainer.py)                                           -> metrics
    engine.update_weights(policy) every rollout.sync_interval steps
    every eval.interval steps: environment.evaluate (greedy by default)                  -> eval/* metrics
    rank 0: progress bar, metrics.jsonl, TensorBoard (job/reporting.py); every rank: checkpoint, HF export when due
    rank 0, every logging.sample_interval steps and every evaluation: decoded samples -> samples.jsonl

At the end (rank 0): ``reward_loss.png`` and ``summary.txt`` in ``logging.output_dir``. A sample whose scoring
raised is left out of training by the environment (``environments/failures.py``); rank 0 prints the run's first
one, once; a step where every sample failed stops the run (``AllSamplesFailed``: one line, exit code 2, the last
checkpoint kept). Rollouts of step ``k``
depend only on ``(seed, k)``, the weights and the environment's data position (saved in every checkpoint, with
the batches already generated for the steps after it), so a run resumed from the checkpoint of step ``k``
continues exactly as the uninterrupted run would have. Ctrl-C keeps
the last complete checkpoint (saves are atomic) and says which; running the same command again resumes from it
(before the first checkpoint it says that the next run starts from the beginning).

    python -m megatron_rl.job.main [--config X.yaml] [section.key=value ...]   (no --config: job/paths.py picks)

A configuration mistake (``ConfigError``: a bad key or value, a prompt file or reward function that does not
work, a world size the parallel sizes do not divide) is
printed once, by rank 0, without a traceback, and every rank exits with code 2. So is a resume that finds no
checkpoint that verifies (a ``ValueError`` naming each one; a damaged newest one alone is skipped with a
warning, see ``megatron_rl/checkpoint/dist.py``) and a save that hits a full or read-only disk (one line naming
the directory and the intact previous checkpoint; exit code 1). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import ConfigError
from megatron_rl.distributed import preemption
from megatron_rl.environments.base import Environment, Evaluation, Rollouts
from megatron_rl.environments.failures import AllSamplesFailed
from megatron_rl.environments.registry import make_environment
from megatron_rl.inference.builtin_engine import rollout_seed
from megatron_rl.inference.engine import EngineError, EngineStartError, RolloutEngine, SamplingSpec
from megatron_rl.inference.registry import engine_entry
from megatron_rl.job import gate, startup
from megatron_rl.job.config import JobConfig, dump_job_config, load_job_config
from megatron_rl.job.paths import base_config, resolve_config
from megatron_rl.job.pipeline import RolloutPipeline
from megatron_rl.job.reporting import RunReporter, WallTimes, launch_time, process_start_time
from megatron_rl.metrics import Metric

if TYPE_CHECKING:  # type hints only: these modules (and megatron-core) are imported where the job starts
    from megatron_rl.distributed.bootstrap import ParallelGroups
    from megatron_rl.model.critic import MegatronCritic
    from megatron_rl.model.policy import MegatronPolicy
    from megatron_rl.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="megatron_rl main job (RL on an environment: the digit game by "
                                     "default, or prompt files + a reward function)")
    parser.add_argument("--config", action="append", default=None, help="YAML of config overrides; repeated: "
                        "layers, each over the ones before (default: job/paths.py: base_config, the user-job config "
                        "for prompt files, else the digit game's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-3 job.num_steps=20")
    return parser.parse_args(argv)


@dataclass
class Job:
    """Everything the loop needs, built once."""

    config: JobConfig
    groups: ParallelGroups
    environment: Environment
    engine: RolloutEngine | None
    """Generates the rollouts (``rollout.engine``): started by ``run`` once the resume point is known (a finished
    run starts none); closed by ``main``."""
    sampling: SamplingSpec
    eval_sampling: SamplingSpec
    policy: MegatronPolicy
    critic: MegatronCritic | None
    """The value model (PPO with a critic: ``algorithm.advantage_estimator: gae``), else None."""
    trainer: Trainer
    save_dir: Path
    is_rank0: bool
    pipeline: RolloutPipeline | None = None
    """The batches of the coming steps (``job/pipeline.py``: ``rollout.max_staleness``); built by ``run``."""
    resumed_pipeline: dict | None = None
    """The checkpoint's generated batches of the steps after it (``RolloutPipeline.state_dict``)."""
    trained_step: int = 0
    """The last RL step whose train step finished."""
    saved_step: int = 0
    """The step of the newest checkpoint (the resumed one, or the last ``save``)."""


# megatron-core announces at import, once per module and rank, that it falls back from TransformerEngine/Apex
# (expected on CPU; the README says TE/Apex are optional) and that a cuda-graph default is deprecated (we use no
# cuda graphs). Silenced so the job's own output stays readable; every other warning is kept.
def main(argv: list[str] | None = None) -> int:
    stop = gate.wait()  # the pre-flight's verdict when the launcher runs it beside the ranks (job/gate.py)
    if stop is not None:
        return stop
    args = parse_args(argv)
    preemption.watch_rank()  # SIGUSR1/SIGTERM: save at the next step boundary, exit code 3
    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed

    try:
        layers = [resolve_config(c) for c in args.config] if args.config else [base_config(None, args.overrides)[0]]
        config = load_job_config(layers, args.overrides)
        environment = make_environment(config)  # reads the data, checks the reward function: before any collective
        startup.mark("imports")
        groups = initialize_distributed(config.rl.parallel, config.rl.seed)  # checks the world size first
        startup.mark("distributed")
    except ConfigError as err:
        return report_config_error(err)
    job = None
    try:
        job = build_job(config, groups, environment)
        startup.mark("model")
        return run(job)
    except CheckpointProblem as err:
        return report_error(str(err), kind="checkpoint error", code=err.code)
    except ConfigError as err:  # found while running, the same on every rank
        return report_config_error(err)
    except (EngineError, EngineStartError) as err:  # the same message on every rank
        return report_error(str(err), kind="engine error", code=1)
    except AllSamplesFailed as err:
        return report_error(f"{err}. Nothing to train on: stopped, the last complete checkpoint in {config.save_dir} "
                            "is kept; fix it and run the same command again to resume", kind="rollout error",
                            code=2)
    finally:
        if job is not None and job.engine is not None:
            job.engine.close()
        if job is not None and job.trainer.distillation is not None:
            job.trainer.distillation.close()  # a served teacher's vLLM server
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


def build_job(config: JobConfig, groups: ParallelGroups, environment: Environment) -> Job:
    """Policy (+ reference for KL, + critic, + distillation teachers), trainer, rollout engine (the config was
    validated when loaded)."""
    from megatron_rl.distillation.teachers import build_distillation, check_teachers
    from megatron_rl.model.critic import MegatronCritic
    from megatron_rl.trainer import Trainer

    job, batch, pad_id = config.job, config.rl.batch, environment.pad_token_id
    if groups.rank == 0 and hasattr(environment, "describe"):
        print(environment.describe(), flush=True)
    check_teachers(config.rl)  # files only: a teacher that cannot score the student's tokens stops every rank here
    policy = build_policy(config, groups, pad_id)
    rl = policy.config  # with model.hf_path: the model section as read from the checkpoint's config.json
    reference = None
    if rl.algorithm.use_kl_loss or rl.algorithm.use_kl_in_reward:
        reference = type(policy)(rl, groups, role="reference", pad_token_id=pad_id)  # a VL policy's sees images
        reference.load_full_state_dict(policy.full_state_dict())  # the reference is the initial policy
    critic = None
    if rl.critic.active(rl.algorithm):
        critic_cfg = rl.critic
        size, epochs = critic_cfg.updates(batch)
        critic_steps = batch.train_batch_size // size * epochs
        critic = MegatronCritic(rl, groups, pad_token_id=pad_id, total_optim_steps=job.num_steps * critic_steps)
        if critic_cfg.init_from_policy:
            critic.load_trunk(policy.full_state_dict())
    trainer = Trainer(rl, policy, reference=reference, critic=critic,
                      distillation=build_distillation(rl, groups, pad_id, config.rollout),
                      skip_old_logprobs=config.rollout.max_staleness == 0)  # async: keep the forward
    sampling = SamplingSpec(max_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
                            stop_token_ids=environment.stop_token_ids)
    eval_sampling = SamplingSpec(max_tokens=config.eval.max_new_tokens or job.max_new_tokens,
                                 temperature=config.eval.temperature, stop_token_ids=environment.stop_token_ids)
    return Job(
        config=config,
        groups=groups,
        environment=environment,
        engine=None,
        sampling=sampling,
        eval_sampling=eval_sampling,
        policy=policy,
        critic=critic,
        trainer=trainer,
        save_dir=config.save_dir,
        is_rank0=groups.rank == 0,
    )


def build_policy(config: JobConfig, groups: ParallelGroups, pad_id: int) -> MegatronPolicy:
    """A random policy of ``model``'s shapes, or the checkpoint at ``model.hf_path`` (shapes, weights)."""
    from megatron_rl.model.policy import MegatronPolicy

    total_optim_steps = config.job.num_steps * config.optim_steps_per_rl_step
    if config.rl.model.hf_path is None:
        return MegatronPolicy(config.rl, groups, pad_token_id=pad_id, total_optim_steps=total_optim_steps)
    from megatron_rl.hf.weights import policy_from_hf

    policy = policy_from_hf(config.rl, groups, total_optim_steps=total_optim_steps)  # pad id: the tokenizer's
    assert policy.pad_token_id == pad_id, (policy.pad_token_id, pad_id)  # the environment reads the same tokenizer
    return policy


def start_engine(config: JobConfig, policy: MegatronPolicy, pad_id: int) -> RolloutEngine:
    """The engine ``rollout.engine`` names (``inference/registry.py``), on the policy's current weights.
    Collective; an engine that cannot start raises ``EngineStartError`` (one line on every rank)."""
    from megatron_rl.inference.registry import start_engine as start

    return start(config, policy, pad_token_id=pad_id)


def run(job: Job) -> int:
    """Resume if possible, then RL steps until ``job.num_steps``; returns the process exit code."""
    config = job.config
    start_step = resume(job)
    startup.mark("resume")
    if start_step >= config.job.num_steps:
        return report_finished(job, start_step)
    vote = preemption.stop_vote(job.groups.device)  # signalled while starting: nothing new to save
    if vote:
        return report_stopped(job, vote, start_step)
    job.engine = start_engine(config, job.policy, job.environment.pad_token_id)  # on the resumed weights
    job.pipeline = build_pipeline(job, start_step)
    startup.mark("engine")
    job.trained_step = job.saved_step = start_step
    reporter = open_reporter(job, start_step)
    baseline = job.environment.random_baseline(config.rl.seed) if job.is_rank0 else None
    started, step = time.time(), start_step
    logging = config.rl.logging
    try:
        for step in range(start_step + 1, config.job.num_steps + 1):
            try:
                metrics, rollouts = rl_step(job, step)
            except Exception as err:
                save_before_stopping(job, err)
                raise
            if reporter is not None:
                reporter.note_failures(rollouts.failures, "reward.function" if job.config.environment == "single_turn"
                                       else "the environment")
                if due(logging.sample_interval, step, config.job.num_steps):
                    reporter.log_samples(step, "train", rollouts.samples[:logging.num_samples])
            if due(config.eval.interval, step, config.job.num_steps):
                evaluation = evaluate(job, step)
                metrics.update(evaluation.metrics)
                if reporter is not None:
                    reporter.log_samples(step, "eval", evaluation.samples[:logging.num_samples])
            if reporter is not None:
                reporter.log_step(step, metrics)
            if checkpoint_due(config, step):
                save(job, step)
            if config.rl.model.hf_path and config.export.enabled and due(config.export.interval, step,
                                                                          config.job.num_steps, always_last=True):
                export(job, step, reporter)
            if stopped := stop_at_boundary(job, step):
                if reporter is not None:
                    reporter.close()
                return report_stopped(job, stopped, step)
    except KeyboardInterrupt:  # saves are atomic: an interrupted save leaves the previous checkpoint as latest
        if reporter is not None:
            reporter.close()
        from megatron_rl.distributed.launch import report_error as report

        return report(interrupted_message(step, job.save_dir), code=130)
    except AllSamplesFailed:
        if reporter is not None:
            reporter.close()
        raise
    if reporter is not None:
        summary = reporter.finish(baseline=baseline, times=WallTimes.since(
            launch_time(), started, startup_parts=startup.split(launch_time(), process_start_time())))
        print(f"\n{summary}\nOutputs: {reporter.output_dir} (metrics.jsonl, tensorboard/, reward_loss.png, "
              f"summary.txt); checkpoints: {job.save_dir}", flush=True)
    return 0


def stop_at_boundary(job: Job, step: int) -> int:
    """Collective, at the end of ``step``: the stop signal some rank or launcher got (0: none, go on); when one
    did, the checkpoint of ``step`` is saved first unless it was due anyway (``distributed/preemption.py``)."""
    vote = preemption.stop_vote(job.groups.device)
    action = preemption.boundary_action(vote, step, job.config.job.num_steps, job.saved_step)
    if action is preemption.Action.SAVE_AND_STOP:
        job.pipeline.drain()  # a checkpoint holds whole batches (partial rollouts: the one in flight ends)
        save(job, step)
    return 0 if action is preemption.Action.CONTINUE else vote


def report_stopped(job: Job, vote: int, step: int) -> int:
    """The one line of a preemption stop (printed once by the launcher); exit code 3."""
    from megatron_rl.checkpoint.layout import checkpoint_dirs
    from megatron_rl.distributed.launch import report_error as report

    saved = checkpoint_dirs(job.save_dir)
    message = preemption.stopped_message(vote, step, job.config.job.num_steps, str(saved[-1]) if saved else None)
    return report(message, code=preemption.EXIT_CODE)


def interrupted_message(step: int, save_dir: Path) -> str:
    """What Ctrl-C during ``step`` leaves: the newest checkpoint to resume from (saves are atomic: a ``step_*``
    directory is complete), or none yet, and then the next run starts from the beginning."""
    from megatron_rl.checkpoint.layout import checkpoint_dirs, step_of

    saved = checkpoint_dirs(save_dir)
    if not saved:
        return (f"\nmegatron_rl: interrupted during step {step}, before the first checkpoint: nothing was saved "
                f"in {save_dir}, so the same command starts again from the beginning (checkpoint.save_interval "
                "sets how often a run saves).")
    return (f"\nmegatron_rl: interrupted during step {step}; the last complete checkpoint, step {step_of(saved[-1])} "
            f"in {save_dir}, is kept. Run the same command again to resume from it.")


def report_finished(job: Job, step: int) -> int:
    """The run in ``save_dir`` already reached ``job.num_steps``: one line on rank 0 saying so and what to
    change; exit code 0 (the state the command asks for holds, as for ``make`` on a built target). Nothing in
    the output directory is rewritten: its config.yaml and summary.txt keep describing the run that happened."""
    if job.is_rank0:
        num_steps, output_dir = job.config.job.num_steps, job.config.rl.logging.output_dir
        print(f"megatron_rl: the run in {job.save_dir} finished at step {step} (job.num_steps={num_steps}); "
              f"nothing to do, nothing rewritten. To train on, raise job.num_steps (e.g. job.num_steps="
              f"{step + num_steps}); for a new run, set a new logging.output_dir (now {output_dir})", flush=True)
    return 0


def build_pipeline(job: Job, start_step: int) -> RolloutPipeline:
    """The rollouts of the coming steps (``rollout.max_staleness``; collective). The engine starts on the weights
    of ``start_step`` (the resumed ones)."""
    config, rl = job.config, job.config.rl

    def generate(step: int) -> Rollouts:  # the same on every rank, seeded by (seed, step)
        return job.environment.rollout(
            job.engine, job.sampling,
            num_prompts=rl.batch.train_batch_size,
            n_samples_per_prompt=config.job.n_samples_per_prompt,
            seed=rollout_seed(rl.seed, step),
            step_wise=rl.stepwise.step_wise_trajectories,
        )

    return RolloutPipeline(generate, max_staleness=config.rollout.max_staleness, weights_step=start_step,
                           threaded=job.engine.capabilities.concurrent, partial=config.rollout.partial_rollouts,
                           engine=job.engine, state=job.resumed_pipeline)


def rl_step(job: Job, step: int) -> tuple[dict[str, float], Rollouts]:
    """The rollouts of ``step`` (generated now, or ahead: ``job/pipeline.py``), one train step, then the engine's
    weight sync when due. Same on every rank (seeded by (seed, step)). Returns the metrics and the rollouts
    (their samples and failures are logged by rank 0)."""
    config = job.config
    started = time.perf_counter()
    ahead = config.rollout.max_staleness
    job.pipeline.launch_through(step + ahead, first_step=step)
    batch = job.pipeline.take(step)
    rollouts = batch.rollouts
    check_ranks_agree(job.groups, [rollouts.output["response_ids"], rollouts.output["rewards"]])
    waited_s = time.perf_counter() - started
    capabilities = job.engine.capabilities
    sleeping = capabilities.sleeps and config.rollout.sleep_while_training
    if sleeping:  # colocated engines give the trainer their device memory (rank 0 asks them; docs/INFERENCE.md)
        job.engine.sleep()
    metrics = job.trainer.train_step(rollouts.output)
    job.trained_step = step
    if sleeping:
        job.engine.wake()
    metrics.update(rollouts.metrics)
    if job.is_rank0:
        check_agreement(config, step, metrics)
    metrics["timing/rollout_s"] = batch.rollout_s
    metrics["rollout/staleness_mean"], metrics["rollout/staleness_max"] = job.pipeline.staleness(batch, step)
    if ahead:
        drain_started = time.perf_counter()
        if not job.pipeline.partial or settles(config, step):
            job.pipeline.drain()  # a generation in flight ends on the weights it started with
        metrics["timing/rollout_wait_s"] = waited_s + time.perf_counter() - drain_started
    if not capabilities.own_weights:  # the engine is the policy: it samples from the newest weights
        job.pipeline.synced(step)
    elif step % config.rollout.sync_interval == 0:
        metrics["timing/weight_sync_s"] = job.engine.update_weights(job.policy)
        metrics["rollout/weight_sync_bytes"] = float(job.engine.last_sync_bytes)  # the model, or LoRA's adapter
        job.pipeline.synced(step)
    metrics.update(job.engine.step_metrics())  # e.g. the vLLM fleet's restarts and live engines (rank 0)
    metrics["timing/step_s"] = time.perf_counter() - started
    return metrics, rollouts


def agreement_checked(config: JobConfig) -> bool:
    """Whether the engine's log-probs must agree with the trainer's old log-probs: it samples with its own
    weights (``capabilities.own_weights``), from the trainer's current ones and distribution (``on_policy``)."""
    from megatron_rl.inference.config import on_policy

    return (engine_entry(config.rollout).capabilities.own_weights
            and on_policy(config.rollout, config.job.temperature, config.job.top_p))


def check_agreement(config: JobConfig, step: int, metrics: dict[str, float]) -> None:
    """Rank 0 warns (one line) when the on-policy engine's log-probs drift past ``AGREEMENT_BOUNDS``: a weight
    sync that left stale or wrong weights shows here first."""
    from megatron_rl.inference.config import agreement_bound, engine_dtype

    diff = metrics.get("rollout/logprob_abs_diff_mean")
    if diff is None or not agreement_checked(config):
        return
    model = config.rl.model
    dtype = engine_dtype(config.rollout, model, config.rl.parallel.device)[0]
    bound = agreement_bound(dtype, model.params_dtype)
    if diff > bound:
        print(f"megatron_rl main job: WARNING step {step}: the engine's log-probs differ from the trainer's by "
              f"{diff:.3g} on average, above the {bound:.3g} a {dtype} engine allows (docs/INFERENCE.md); the "
              "weight sync or the engine's model may be wrong", flush=True)


def settles(config: JobConfig, step: int) -> bool:
    """Partial rollouts: the generation ahead is waited for at the end of ``step`` anyway (a checkpoint holds
    whole batches; an evaluation uses the engines alone; the last step)."""
    return (checkpoint_due(config, step) or due(config.eval.interval, step, config.job.num_steps)
            or step == config.job.num_steps)


def due(interval: int, step: int, last_step: int, *, always_last: bool = False) -> bool:
    """Every ``interval`` steps (0 = never, or only at ``last_step`` with ``always_last``); the last step too
    when the interval is on."""
    if interval <= 0:
        return always_last and step == last_step
    return step % interval == 0 or step == last_step


def evaluate(job: Job, step: int) -> Evaluation:
    """``eval/reward_mean`` and ``eval/pass_rate`` on the held-out prompts (collective), plus its time, and a few
    decoded samples."""
    started = time.perf_counter()
    ev = job.config.eval
    evaluation = job.environment.evaluate(job.engine, job.eval_sampling,
                                          seed=rollout_seed(job.config.rl.seed, -2 - step),
                                          num_prompts=ev.num_prompts, pass_threshold=ev.pass_threshold)
    evaluation.metrics["timing/eval_s"] = time.perf_counter() - started
    return evaluation


def export(job: Job, step: int, reporter: RunReporter | None) -> None:
    """HF export of the policy into ``<export dir>/step_<N>`` (collective; written under a temporary name and
    renamed, so a directory with the final name is always complete)."""
    from megatron_rl.hf.weights import export_policy_to_hf

    final = job.config.export_dir / f"step_{step}"
    tmp = final.with_name(f".tmp.{final.name}")
    if job.is_rank0 and tmp.exists():
        shutil.rmtree(tmp)
    export_policy_to_hf(job.policy, tmp)  # rank 0 writes; ends with a barrier
    if job.is_rank0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if reporter is not None:
            reporter.write(f"exported the policy of step {step} as a Hugging Face checkpoint: {final}")


def check_ranks_agree(groups: ParallelGroups, rollouts: list) -> None:
    """Every rank must have sampled the same tokens and given them the same rewards (a reward function that
    failed on one rank only drops other samples there), else each would train on different data (silently).
    One world-level gather of the checksum a step (the DP, TP, PP and CP groups together span the world); only on
    a mismatch each group is asked, to name the one whose ranks differ."""
    import torch.distributed as dist

    from megatron_rl.distributed.metrics import reduce_metrics

    checksum = zlib.crc32(json.dumps(rollouts).encode())
    probe = {"max": Metric(checksum, 1.0, "max"), "min": Metric(checksum, 1.0, "min")}
    agreed = reduce_metrics(probe, dist.group.WORLD)
    if agreed["max"].value == agreed["min"].value:
        return
    for name in ("dp_group", "tp_group", "pp_group", "cp_group"):
        agreed = reduce_metrics(probe, getattr(groups, name))
        if agreed["max"].value != agreed["min"].value:
            raise RuntimeError(f"ranks of the {name} sampled different rollouts (checksums {agreed['min'].value} "
                               f"vs {agreed['max'].value}): sampling must be identical on every rank")
    raise RuntimeError("ranks sampled different rollouts: sampling must be identical on every rank")


def open_reporter(job: Job, start_step: int) -> RunReporter | None:
    if not job.is_rank0:
        return None
    config, logging = job.config, job.config.rl.logging
    output_dir = Path(logging.output_dir)
    dump_job_config(config, output_dir / "config.yaml")
    g = job.groups
    layout = (f"TP{g.tp_size} PP{g.pp_size} DP{g.dp_size}" + (f" CP{g.cp_size}" if g.cp_size > 1 else "")
              + (f" EP{g.ep_size}" if g.ep_size > 1 else ""))
    print(f"megatron_rl main job: {g.world_size} rank(s) ({layout}); outputs in {output_dir.resolve()}, "
          f"checkpoints in {job.save_dir.resolve()}" + (f"; resuming after step {start_step}" if start_step else ""),
          flush=True)
    return RunReporter(output_dir, total_steps=config.job.num_steps, start_step=start_step,
                       tensorboard=logging.tensorboard, progress_bar=logging.progress_bar,
                       log_interval=logging.log_interval)


# --------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------

def save_before_stopping(job: Job, err: Exception) -> None:
    """``err`` is a failed generation (the same error on every rank: ``job/pipeline.py``) and steps were trained
    since the last checkpoint (generated ahead, ``rollout.max_staleness``, or a rare ``checkpoint.save_interval``):
    save them before the error stops the job, so that a resumed run loses no trained step and trains none twice.
    Other errors save nothing (they may have hit one rank only, where a collective save would hang)."""
    failure = job.pipeline.failure if job.pipeline is not None else None
    if failure is None or err is not failure.error or job.trained_step <= job.saved_step:
        return
    job.pipeline.drain()  # the batches still in flight end (the environment's position stops moving)
    save(job, job.trained_step)
    if job.is_rank0:
        print(f"megatron_rl main job: the rollouts of step {failure.step} failed; saved the steps trained "
              f"before it (checkpoint of step {job.trained_step}) first", flush=True)


def checkpoint_due(config: JobConfig, step: int) -> bool:
    """Every ``checkpoint.save_interval`` steps (0 = never in between) and always after the last step."""
    return due(config.rl.checkpoint.save_interval, step, config.job.num_steps, always_last=True)


def save(job: Job, step: int) -> None:
    """Atomic distributed checkpoint of the policy (model, optimizer, LR schedule, RNG) and the loop state (step,
    optimizer steps, the environment's data position); the critic's (model, optimizer, LR schedule) in
    ``save_dir/critic`` first (``checkpoint/critic.py``)."""
    from megatron_rl.checkpoint import save_with_critic
    from megatron_rl.checkpoint.dist import STORAGE_ERRNOS

    try:
        state = {"step": step, "optimizer_steps": job.trainer.optimizer_steps,
                 "environment": job.environment.state_dict()}  # counts the prompts of the batches ahead too
        ahead = job.pipeline.state_dict() if job.pipeline is not None else {}
        if ahead:  # generated for the coming steps (rollout.max_staleness): trained first by a resumed run
            state["rollouts_ahead"] = ahead
        save_with_critic(job.policy, job.critic, job.save_dir, state)
        job.saved_step = step
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
    job.environment.load_state_dict(state.get("environment", {}))
    job.resumed_pipeline = state.get("rollouts_ahead")
    return int(state["step"])


if __name__ == "__main__":
    sys.exit(main())
