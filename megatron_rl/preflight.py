"""Pre-flight: the checks that need no model and no process group, run before any rank starts.

Place in the data flow: before everything (``run_megatron.sh`` runs ``python -m megatron_rl.job.preflight`` before
torchrun; library users call ``check_run(config, world_size)`` before ``initialize_distributed``). A mistake
found here costs a second instead of a rank start-up, a model build, or ``save_interval`` train steps:

- the config validates for this world size (``MegatronRLConfig.validate``: the one owner of every rule);
- a mixture-of-experts layout can be built (``check_moe_layout``: the builder's rule, ``model/moe.py: validate``,
  e.g. ``model.num_moe_experts`` divisible by ``parallel.expert_model_parallel_size``);
- ``logging.output_dir`` and the checkpoint directory are created and proven writable (a probe file is
  written, renamed and deleted: a read-only mount or a missing permission fails here, not at the first save);
- the free space of the checkpoint filesystem is compared with ``checkpoint.keep_last + 1`` checkpoints of
  the estimated size (``estimate_checkpoint_bytes``): a warning when it is lower;
- ``parallel.device=cuda`` needs a visible CUDA device (``bootstrap.select_device``, the rule the ranks apply);
- a run that will resume (``checkpoint.resume`` and a ``step_*`` directory in the checkpoint directory) must
  resume a checkpoint of this model and algorithm (``check_resume_target``): resuming another run's directory
  would fail in the ranks (another shape) or silently switch algorithms (a critic dropped).

Failures raise ``ValueError`` (a ``ConfigError`` for config values) naming the key or directory, the value and
the fix; the command line (``main``) prints it once, without a traceback, and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable, Sequence

from megatron_rl.config import ConfigError, MegatronRLConfig, ModelConfig, load_config, on_cpu

BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2}
OPTIMIZER_BYTES_PER_PARAM = {"adam": 8, "sgd": 4}
"""fp32 optimizer state per parameter: Adam's two moments, SGD's momentum. Low-precision params add a 4-byte
fp32 main copy (megatron's mixed-precision optimizer)."""


def checkpoint_dir(config: MegatronRLConfig) -> Path:
    """``checkpoint.save_dir``, or ``<logging.output_dir>/checkpoints`` when unset (CheckpointConfig)."""
    save_dir = config.checkpoint.save_dir
    return Path(save_dir) if save_dir else Path(config.logging.output_dir) / "checkpoints"


def count_parameters(model: ModelConfig) -> int:
    """Parameters of the Llama-style GPT of ``model/builder.py`` (RMSNorm, SwiGLU, GQA, no linear biases); an MoE
    model (``model.num_moe_experts``) has every expert of every layer plus its router."""
    h, layers = model.hidden_size, model.num_layers
    kv = model.kv_channels or h // model.num_attention_heads
    q_width, kv_width = model.num_attention_heads * kv, model.num_query_groups * kv
    attention = h * (q_width + 2 * kv_width) + q_width * h + (q_width + 2 * kv_width) * model.add_qkv_bias
    experts = model.num_moe_experts or 1
    ffn = (model.moe_ffn_hidden_size or model.ffn_hidden_size) if model.num_moe_experts else model.ffn_hidden_size
    mlp = experts * 3 * h * ffn + (h * experts if model.num_moe_experts else 0)
    norms = 2 * h + (2 * kv if model.qk_layernorm else 0)
    embeddings = model.vocab_size * h * (1 if model.share_embeddings_and_output_weights else 2)
    return layers * (attention + mlp + norms) + embeddings + h


def estimate_checkpoint_bytes(config: MegatronRLConfig) -> int:
    """params x (bytes per param + optimizer bytes per param): one checkpoint with its optimizer state."""
    param_bytes = BYTES_PER_PARAM[config.model.params_dtype]
    optimizer_bytes = OPTIMIZER_BYTES_PER_PARAM[config.optimizer.optimizer] + (4 if param_bytes < 4 else 0)
    return count_parameters(config.model) * (param_bytes + optimizer_bytes)


def check_moe_layout(config: MegatronRLConfig) -> None:
    """ConfigError when the MoE layout cannot be built: the rule the ranks' model builder applies
    (``model/moe.py: validate``: experts divisible by the EP size, EP only with experts, TP only with sequence
    parallelism, the expert FFN divisible by the expert-TP size, expert TP 1 on CPU). Imports megatron-core only for an MoE model or EP > 1."""
    if config.model.num_moe_experts is None and config.parallel.expert_model_parallel_size == 1:
        return
    from megatron_rl.model.moe import validate  # "No CUDA runtime is found": warnings_filter.CPU_LOG_PREFIXES

    try:
        validate(config.model, config.parallel, on_cpu=on_cpu(config.parallel.device))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_writable(directory: Path, key: str) -> None:
    """Create ``directory`` and prove it writable (write + rename + delete a probe file); ValueError naming
    ``key`` otherwise."""
    probe = directory / f".preflight.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("megatron_rl pre-flight probe\n")
        probe.replace(probe.with_name(probe.name + ".renamed"))
        probe.with_name(probe.name + ".renamed").unlink()
    except OSError as err:
        raise ValueError(
            f"{key}={str(directory)!r} is not writable ({err.strerror or err}); choose a directory this user "
            f"can write (set {key}=...), or fix its permissions / free space"
        ) from None


def check_free_space(directory: Path, config: MegatronRLConfig) -> str | None:
    """A warning (returned and issued) when ``directory`` has less free space than ``keep_last + 1`` estimated
    checkpoints (one more is written before the oldest is pruned)."""
    needed = estimate_checkpoint_bytes(config) * (config.checkpoint.keep_last + 1)
    free = shutil.disk_usage(directory).free
    if free >= needed:
        return None
    message = (f"checkpoint directory {directory} has {free / 2**30:.2f} GiB free, less than the ~"
               f"{needed / 2**30:.2f} GiB that checkpoint.keep_last={config.checkpoint.keep_last} + 1 checkpoints of "
               "this model need; free space, choose another checkpoint.save_dir, or lower checkpoint.keep_last")
    warnings.warn(message, stacklevel=2)
    return message


def check_device(config: MegatronRLConfig) -> None:
    """``parallel.device=cuda`` without a visible CUDA device: the ranks' ``ConfigError``, raised here first."""
    if config.parallel.device == "cuda":
        from megatron_rl.distributed.bootstrap import select_device

        select_device(config.parallel, local_world_size=1, local_rank=0)


RUN_DEFINING_KEYS = (("algorithm", "advantage_estimator"), ("algorithm", "policy_loss_type"))
"""Saved config keys that make a checkpoint another run's when they differ (beyond the model's shape)."""


def check_resume_target(config: MegatronRLConfig) -> None:
    """ConfigError when the checkpoint a resume would load belongs to another run: another model shape
    (``checkpoint.dist.SHAPE_FIELDS``), advantage estimator, policy loss, a critic on one side only, or a vision
    tower frozen in the checkpoint but trained by the config.

    The checkpoint is the first of ``layout.resume_candidates`` with a readable manifest (the one the ranks try
    first); whether its files verify is left to the ranks. The message names the directory, the checkpoint's
    step and each difference, and the fix (a new output directory, or the keys of that run).
    """
    save_dir = checkpoint_dir(config)
    if not config.checkpoint.resume or not any(p.name.startswith("step_") for p in save_dir.iterdir()):
        return
    target = _resume_target(save_dir, config.checkpoint.resume_fallback)
    diffs = _run_differences(target, save_dir, config) if target is not None else []
    if diffs:
        raise ConfigError(
            f"checkpoint.save_dir={str(save_dir)!r} holds another run ({target[0].name}): {'; '.join(diffs)}. Resume "
            f"it with that run's settings, or start this run elsewhere (a new logging.output_dir or checkpoint.save_dir)"
        )


def _resume_target(save_dir: Path, fallback: bool) -> tuple[Path, dict] | None:
    """``(checkpoint directory, manifest)`` the ranks would try first; None when none has a manifest (the ranks
    then report every candidate's reason)."""
    from megatron_rl.checkpoint import layout  # megatron-core: imported only when there is something to resume

    try:
        candidates = layout.resume_candidates(save_dir, fallback)
    except ValueError:
        return None
    manifests = ((ckpt, layout.manifest_or_problem(ckpt)[0]) for ckpt in candidates)
    return next(((ckpt, manifest) for ckpt, manifest in manifests if manifest is not None), None)


def _run_differences(target: tuple[Path, dict], save_dir: Path, config: MegatronRLConfig) -> list[str]:
    """``"key: checkpoint a vs config b"`` for each way the saved run differs from ``config`` (see
    ``check_resume_target``)."""
    import yaml

    from megatron_rl.checkpoint import layout
    from megatron_rl.checkpoint.critic import critic_save_dir
    from megatron_rl.checkpoint.dist import model_shape_mismatches
    from megatron_rl.config import config_to_dict

    ckpt, manifest = target
    current = config_to_dict(config)
    diffs = [f"model.{d}" for d in model_shape_mismatches(manifest["model"], current["model"], "checkpoint")]
    try:
        saved = yaml.safe_load((ckpt / layout.CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    for section, key in RUN_DEFINING_KEYS:
        was = saved.get(section, {}).get(key) if isinstance(saved.get(section), dict) else None
        if was is not None and was != current[section][key]:
            diffs.append(f"{section}.{key}: checkpoint {was!r} vs config {current[section][key]!r}")
    if (saved.get("model") if isinstance(saved.get("model"), dict) else {}).get("freeze_vision") \
            and not config.model.freeze_vision:  # the other way round resumes (the tower's Adam state is not read)
        diffs.append("model.freeze_vision: checkpoint true vs config false (it holds no optimizer state for the "
                     "vision tower)")
    has_critic = {"checkpoint": bool(layout.checkpoint_dirs(critic_save_dir(save_dir))),
                  "config": config.critic.active(config.algorithm)}
    if has_critic["checkpoint"] != has_critic["config"]:
        diffs.append("critic: " + " vs ".join(f"{side} {'with' if has else 'without'}" for side, has in has_critic.items()))
    return diffs


def check_run(config: MegatronRLConfig, world_size: int | None = None) -> list[str]:
    """Every pre-flight check (module docstring) for ``config`` on ``world_size`` ranks; returns the warnings.

    Raises ``ConfigError`` for a config value, ``ValueError`` for a directory; creates the output and
    checkpoint directories as a side effect (the run creates them anyway).
    """
    config.validate(world_size=world_size)
    check_moe_layout(config)
    check_device(config)
    check_writable(Path(config.logging.output_dir), "logging.output_dir")
    save_dir = checkpoint_dir(config)
    check_writable(save_dir, "checkpoint.save_dir")
    check_resume_target(config)
    low_space = check_free_space(save_dir, config)
    return [low_space] if low_space else []


def main(argv: Sequence[str] | None = None,
         load: Callable[[str | list[str], Sequence[str]], MegatronRLConfig] = load_config) -> int:
    """``python -m megatron_rl.preflight --config X [--world-size N] [key=value ...]``: 0 when the run can start
    (one line on stdout naming the output and checkpoint directories of the config as resolved, overrides
    included), 2 (after one line on stderr, no traceback) when it cannot. ``load`` reads an application's config (the
    main job passes its own, ``megatron_rl/job/preflight.py``)."""
    return run(argv, load)[0]


def run(argv: Sequence[str] | None = None,
        load: Callable[[str | list[str], Sequence[str]], MegatronRLConfig] = load_config
        ) -> tuple[int, MegatronRLConfig | None]:
    """``main``'s exit code, and the config it checked (None when it could not be loaded or failed): a launcher
    takes every value it needs from it (``megatron_rl/job/start.py``: the device)."""
    parser = argparse.ArgumentParser(description="megatron_rl pre-flight checks (no model, no process group)")
    parser.add_argument("--config", required=True, action="append", help="YAML of config overrides; repeated: "
                        "layers, each over the ones before")
    parser.add_argument("--world-size", type=int, default=None, help="total number of ranks (NPROC x NNODES)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-3")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        print(f"megatron_rl pre-flight: --world-size={args.world_size} must be >= 1 (NPROC x NNODES)", file=sys.stderr)
        return 2, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warnings are printed below, once, in one line each
            config = load(args.config[0] if len(args.config) == 1 else args.config, args.overrides)
            found = check_run(config, args.world_size)
    except ConfigError as err:
        print(f"megatron_rl pre-flight: config error: {err}", file=sys.stderr, flush=True)
        return 2, None
    except ValueError as err:
        print(f"megatron_rl pre-flight: {err}", file=sys.stderr, flush=True)
        return 2, None
    print(f"megatron_rl pre-flight: ok; outputs go to {Path(config.logging.output_dir).resolve()} "
          f"(logging.output_dir), checkpoints to {checkpoint_dir(config).resolve()}", flush=True)
    for message in found:
        print(f"megatron_rl pre-flight: warning: {message}", file=sys.stderr, flush=True)
    return 0, config


if __name__ == "__main__":
    sys.exit(main())
