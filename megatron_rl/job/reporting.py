"""What the main job shows and leaves behind (rank 0 only): progress bar, metrics files, plot, summary.

Place in the data flow: the last stage of every RL step of ``megatron_rl/job/main.py`` (``RunReporter.log_step``) and
of the run (``RunReporter.finish``). Files under ``logging.output_dir``::

    metrics.jsonl        one JSON object per logged step: {"step": n, "time_s": ..., <metric>: <float>, ...}
    tensorboard/         the same scalars as TensorBoard events (when logging.tensorboard and tensorboard exist)
    reward_loss.png      reward (and eval reward / pass rate, when evaluated) and policy loss vs step (matplotlib);
                         a third panel with the router losses (moe/*) for a mixture-of-experts model
    samples.jsonl        every logging.sample_interval steps and at every evaluation, a few decoded samples, one
                         JSON object each: {"step", "split": "train"|"eval", "row", "prompt", "response",
                         "reward", "error"} (reward null and error set where the reward function raised); a
                         multi-turn episode (step API, agent) adds "turns" (each turn's new prompt text, reply,
                         an agent's tool calls; special tokens kept) and "end"; the same records as TensorBoard
                         text (tag samples/<split>)
    first_failure.txt    the traceback of the run's first failed sample (the one line printed names file:line)
    summary.txt          one paragraph: wall time (start-up, loop, total), start and end reward (or: too short to
                         judge), random baseline (if any), first and last eval, failed samples, and a warning when
                         most steps had no learning signal (rollout/zero_advantage_groups = 1) or the reward never
                         moved, with the likely cause read from the rewards; then the last few samples

Resuming appends to ``metrics.jsonl`` and ``samples.jsonl``; lines of steps after the resume point (a crashed
tail) are dropped first, so each file holds each step once; lines are appended whole (one ``write`` each). Every
file rewritten here (the truncated ``metrics.jsonl`` and ``samples.jsonl``, ``summary.txt``, ``reward_loss.png``)
is replaced atomically (``megatron_rl/atomic.py``): a kill at any instant leaves the old or the new version, so
a resume keeps every row up to its checkpoint. TensorBoard resumes with ``purge_step=start_step + 1``: events of
steps after the checkpoint (the crashed tail) are hidden, none twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.atomic import atomic_replace, atomic_write_text
from megatron_rl.environments.base import Sample
from megatron_rl.environments.failures import FAILED_SAMPLES as FAILED_KEY, SampleFailure
from megatron_rl.job import startup

REWARD_KEY = "reward/mean"
ZERO_ADVANTAGE_KEY = "rollout/zero_advantage_groups"
"""Share of the step's groups whose rewards are all equal (``trainer.py: zero_advantage_metrics``)."""
FAILURE_FILE = "first_failure.txt"
"""The traceback of the run's first failed sample (a reward function, environment or agent that raised)."""
SUMMARY_SAMPLES = 3
"""Samples quoted at the end of ``summary.txt`` (the last ones logged)."""
LOSS_KEY = "policy/loss"
EVAL_KEYS = ("eval/reward_mean", "eval/pass_rate")
MOE_PREFIX = "moe/"
"""Router losses of an MoE model (``MegatronPolicy.forward_backward``: moe/load_balancing_loss, moe/z_loss)."""


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of a metrics JSONL file (an unreadable trailing line, from a killed run, is ignored)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only rows with ``step <= last_step`` (called when resuming from the checkpoint of ``last_step``)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of_line(line) <= last_step]
    atomic_write_text(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))


def _step_of_line(line: str) -> float:
    """The step of one JSONL row; an unreadable line (a killed writer's torn tail) counts as after every step."""
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def _points(rows: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]


def plot_reward_and_loss(rows: list[dict[str, float]], png_path: Path, *, baseline: float | None = None) -> None:
    """Two panels, reward and policy loss vs step; the evaluation's reward and pass rate on the reward panel
    when the run evaluated; a dashed line at the random baseline reward; a third panel with the router losses
    (``moe/*``, each divided by its coefficient) when the model is a mixture of experts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe_keys = sorted({key for row in rows for key in row if key.startswith(MOE_PREFIX)})
    fig, axes = plt.subplots(1, 3 if moe_keys else 2, figsize=(15 if moe_keys else 10, 4))
    ax_reward, ax_loss = axes[:2]
    panels = [(ax_reward, [REWARD_KEY], REWARD_KEY), (ax_loss, [LOSS_KEY], LOSS_KEY)]
    panels += [(axes[2], moe_keys, "router losses (MoE)")] if moe_keys else []
    for ax, keys, title in panels:
        for key in keys:
            points = _points(rows, key)
            if points:
                ax.plot(*zip(*points), marker=".", linewidth=1, label=key)
        ax.set_xlabel("train step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if moe_keys:
        axes[2].legend(loc="upper right")
    evaluated = False
    for key in EVAL_KEYS:
        points = _points(rows, key)
        if points:
            ax_reward.plot(*zip(*points), marker="o", linewidth=1, label=key)
            evaluated = True
    if baseline is not None:
        ax_reward.axhline(baseline, linestyle="--", color="gray", label=f"random policy {baseline:.3f}")
    if baseline is not None or evaluated:
        ax_reward.legend(loc="lower right")
    fig.tight_layout()
    with atomic_replace(png_path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


LAUNCH_TIME_ENV = "MEGATRON_RL_LAUNCH_TIME"
"""Seconds since the epoch when the launch began (``run_megatron.sh`` sets it before its pre-flight)."""
SIGNAL_TOLERANCE = 1e-6
"""Rewards closer than this (relative to 1 or their size) count as equal (``trainer.py: zero_advantage_metrics``)."""


def process_start_time() -> float:
    """When this process started (seconds since the epoch)."""
    import psutil

    return psutil.Process().create_time()


def launch_time() -> float:
    """When the launch began: ``$MEGATRON_RL_LAUNCH_TIME`` (bash's ``$EPOCHREALTIME``, whose decimal mark follows
    the locale), else when this process started."""
    value = os.environ.get(LAUNCH_TIME_ENV, "").replace(",", ".")
    try:
        return float(value)
    except ValueError:
        return process_start_time()


@dataclass(frozen=True)
class WallTimes:
    """Where a run's wall time went (``summary.txt``): the whole launch, not only the loop."""

    startup_s: float
    """From the launch to the first step: pre-flight, ranks, model, engine (vLLM's start), resume."""
    loop_s: float
    """The RL steps: rollouts, train steps, evaluations, checkpoints, exports."""
    total_s: float
    """From the launch to the summary (start-up + loop + what came after the last step)."""
    startup_parts: tuple[tuple[str, float], ...] = ()
    """The start-up split into phases (``job/startup.py``); empty: said as one number."""

    @classmethod
    def since(cls, launched: float, loop_started: float, now: float | None = None,
              startup_parts: Sequence[tuple[str, float]] = ()) -> WallTimes:
        now = time.time() if now is None else now
        return cls(startup_s=loop_started - launched, loop_s=now - loop_started, total_s=now - launched,
                   startup_parts=tuple(startup_parts))

    def phrase(self) -> str:
        parts = (startup.phrase(list(self.startup_parts)) if self.startup_parts
                 else "pre-flight, ranks, model, engine")
        return (f"{self.total_s:.0f} s of wall time: {self.startup_s:.0f} s of start-up ({parts}) and "
                f"{self.loop_s:.0f} s of training loop")


def _equal(a: float, b: float) -> bool:
    return abs(a - b) <= SIGNAL_TOLERANCE * max(1.0, abs(a), abs(b))


def likely_cause(flagged: list[dict[str, float]], rows: list[dict[str, float]]) -> str:
    """Why the steps of ``flagged`` (every group's rewards equal) taught nothing, read from their rewards
    (``reward/min``, ``reward/max``; ``reward/mean`` where those are missing) against the whole run's ``rows``."""
    low = [r.get("reward/min", r.get(REWARD_KEY, math.nan)) for r in flagged]
    high = [r.get("reward/max", r.get(REWARD_KEY, math.nan)) for r in flagged]
    values = [v for v in low + high if math.isfinite(v)]
    if not values:
        return "unknown (no reward/mean in metrics.jsonl)"
    if all(_equal(v, values[0]) for v in values):  # one reward for every response of every such step
        value = values[0]
        run_low = min(r.get("reward/min", r.get(REWARD_KEY, value)) for r in rows)
        run_high = max(r.get("reward/max", r.get(REWARD_KEY, value)) for r in rows)
        named = {0.0: "all zero", 1.0: "all one"}.get(value, f"all {value:g}")
        if value >= 1.0 or (_equal(value, run_high) and not _equal(run_low, run_high)):
            return (f"every response got reward {value:g} ({named}): the prompts are solved; harder prompts teach "
                    "more, or the run can stop here")
        if value <= 0.0 or _equal(value, run_low):
            return (f"every response got reward {value:g} ({named}): the task is out of reach of the policy, or the "
                    "reward function never pays; check samples.jsonl for what it answers, lower the difficulty, "
                    "raise job.max_new_tokens, or reward partial answers")
        return (f"every response got reward {value:g} ({named}): the reward function gives every response the same "
                "score; check it on the responses in samples.jsonl")
    if all(_equal(lo, hi) for lo, hi in zip(low, high)):
        return ("every response of a step got the same reward, which changed from step to step: the outcome "
                "depends on the prompt, not on the response (check the reward function's inputs in samples.jsonl)")
    return ("each prompt's responses got the same reward (prompts differ): the responses of a prompt are alike "
            "(raise job.temperature or job.n_samples_per_prompt) or the reward reads only the prompt")


def no_signal_sentence(rows: list[dict[str, float]]) -> str | None:
    """A warning when the run had no learning signal in most of its steps (every group's rewards equal: every
    GRPO advantage 0) or its mean reward never moved, naming the likely cause from the rewards; None otherwise
    (a group whose responses all score the same is normal once its prompt is solved)."""
    flagged = [r for r in rows if r.get(ZERO_ADVANTAGE_KEY, 0.0) >= 1.0]
    rewards = [r[REWARD_KEY] for r in rows if REWARD_KEY in r and math.isfinite(r[REWARD_KEY])]
    still = len(rewards) >= 3 and all(_equal(v, rewards[0]) for v in rewards)
    if 2 * len(flagged) > len(rows):
        return (f"no learning signal in {len(flagged)} of {len(rows)} steps (every response of a prompt got the "
                f"same reward, so every advantage was 0); likely cause: {likely_cause(flagged, rows)}")
    if still:
        cause = (likely_cause(flagged, rows) if flagged else "the updates are too small to change the answers "
                 "(optimizer.lr, optimizer.lr_warmup_steps) or the run is too short")
        return (f"the mean reward never moved ({rewards[0]:.3f} at each of {len(rewards)} steps); likely cause: "
                f"{cause}")
    return None


def window_mean(rows: list[dict[str, float]], key: str, *, first: bool, window: int = 5) -> float:
    """Mean of ``key`` over the first (or last) ``window`` rows that have it; NaN when none do."""
    values = [r[key] for r in rows if key in r]
    values = values[:window] if first else values[-window:]
    return sum(values) / len(values) if values else float("nan")


def reward_trend(rows: list[dict[str, float]], *, baseline: float | None, window: int) -> str:
    """"the policy learned: mean reward a over the first N steps -> b over the last N", or, for a run with fewer
    than two windows of steps, that it is too short to judge (with its first and last step's reward)."""
    rewarded = [r for r in rows if REWARD_KEY in r]
    if len(rewarded) < 2 * window:
        if not rewarded:
            return "no reward was logged"
        first, last = rewarded[0], rewarded[-1]
        return (f"the run is too short to judge learning ({len(rewarded)} steps with a reward; comparing a first "
                f"and a last window of {window} steps needs {2 * window}): mean reward {first[REWARD_KEY]:.3f} at "
                f"step {int(first['step'])} -> {last[REWARD_KEY]:.3f} at step {int(last['step'])}")
    start = window_mean(rows, REWARD_KEY, first=True, window=window)
    end = window_mean(rows, REWARD_KEY, first=False, window=window)
    verdict = "learned" if end > max(start, baseline if baseline is not None else start) + 0.1 else \
        "did not clearly learn"
    return (f"the policy {verdict}: mean reward {start:.3f} over the first {window} steps -> {end:.3f} over the "
            f"last {window} steps")


def distillation_trend(rows: list[dict[str, float]], *, window: int) -> str | None:
    """"reverse KL to teacher <name> a over the first N steps -> b over the last N" per teacher (the
    ``distill/<name>/reverse_kl`` metrics of on-policy distillation, or ``distill/<name>/full_kl`` under
    ``distillation.kind: full_kl``), None when the run had no teacher."""
    keys = sorted({key for r in rows for key in r
                   if key.startswith("distill/") and key.endswith(("/reverse_kl", "/full_kl"))})
    if not keys:
        return None
    short = len(rows) < 2 * window  # too few steps for two windows: the first and the last step
    span = f"step {int(rows[0]['step'])} -> step {int(rows[-1]['step'])}" if short else \
        f"first {window} steps -> last {window}"
    size = 1 if short else window
    parts = [f"teacher {key.split('/')[1]!r} {window_mean(rows, key, first=True, window=size):.3f} -> "
             f"{window_mean(rows, key, first=False, window=size):.3f}" for key in keys]
    what = "full-vocabulary KL" if all(key.endswith("/full_kl") for key in keys) else "reverse KL"
    return f"{what} to the teacher ({span}): {', '.join(parts)}"


def is_pure_distillation(rows: list[dict[str, float]]) -> bool:
    """A run with a teacher whose rewards were 0 at every step (no reward function): nothing was learned from
    the reward, the reverse KL is the whole signal."""
    return (distillation_trend(rows, window=1) is not None
            and all(r.get(REWARD_KEY, 0.0) == 0.0 and r.get("reward/max", 0.0) == 0.0 for r in rows))


def summary_paragraph(rows: list[dict[str, float]], *, baseline: float | None, times: WallTimes,
                      window: int = 5) -> str:
    """One paragraph: the run's wall time (start-up, loop, total), the reward at the start and end of training
    (means over ``window`` steps; too short a run says so), the random baseline (when the environment has one),
    the first and last evaluation (when the run evaluated), failed samples, and a missing learning signal. With
    distillation teachers, the reverse KL's trend; pure distillation (every reward 0) claims nothing of the reward."""
    steps = int(rows[-1]["step"]) if rows else 0
    pure, distill = is_pure_distillation(rows), distillation_trend(rows, window=window)
    trend = "pure distillation (every reward 0), " + distill if pure else \
        reward_trend(rows, baseline=baseline, window=window) + (f"; {distill}" if distill else "")
    text = f"After {steps} train steps ({times.phrase()} in this run), {trend}"
    if baseline is not None and not pure:
        text += f", against {baseline:.3f} for a uniformly random policy (rewards are in [0, 1])"
    evals = [r for r in rows if EVAL_KEYS[0] in r]
    if evals:
        first, last = evals[0], evals[-1]
        text += (f"; evaluation (step {int(first['step'])} -> {int(last['step'])}): reward "
                 f"{first[EVAL_KEYS[0]]:.3f} -> {last[EVAL_KEYS[0]]:.3f}, pass rate "
                 f"{first.get(EVAL_KEYS[1], float('nan')):.3f} -> {last.get(EVAL_KEYS[1], float('nan')):.3f}")
    failed = sum(r.get(FAILED_KEY, 0.0) for r in rows)
    if failed:
        text += f"; {failed:.0f} samples failed (left out of training: {FAILED_KEY})"
    no_signal = None if pure else no_signal_sentence(rows)  # pure distillation: the task advantage is 0 by design
    return text + "." + (f" {no_signal[0].upper()}{no_signal[1:]}." if no_signal else "")


def format_sample(record: Mapping) -> str:
    """One sample record as a few readable lines (the summary, TensorBoard text); a multi-turn episode turn by
    turn (each turn's new prompt text, reply and tool calls) with why it ended."""
    reward = f"reward {record['reward']:.3f}" if record.get("reward") is not None else f"failed: {record.get('error')}"
    row = f", row {record['row']}" if record.get("row") is not None else ""
    turns = record.get("turns")
    if turns is None:
        return (f"[step {record['step']} {record['split']}{row}] {reward}\n  prompt:   {_clip(record['prompt'])}\n"
                f"  response: {_clip(record['response'])}")
    lines = [f"[step {record['step']} {record['split']}{row}] {reward}, {len(turns)} turn(s), ended: {record.get('end')}"]
    for t, turn in enumerate(turns, start=1):
        lines.append(f"  turn {t} prompt{' (new step)' if turn.get('new_step') else ''}: {_clip(turn['prompt'])}")
        lines.append(f"  turn {t} response: {_clip(turn['response'])}")
        if turn.get("tool_calls"):
            calls = ", ".join(f"{c['name']}({c['arguments']})" for c in turn["tool_calls"])
            lines.append(f"  turn {t} tool calls: {_clip(calls)}")
    return "\n".join(lines)


def sample_record(sample: Sample) -> dict:
    """A sample's fields for samples.jsonl; ``turns`` and ``end`` only for a multi-turn episode."""
    return {k: v for k, v in dataclasses.asdict(sample).items() if v is not None or k not in ("turns", "end")}


def _clip(text: str, limit: int = 300) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class RunReporter:
    """Rank-0 outputs of the main job. Construct only on rank 0."""

    output_dir: Path
    total_steps: int
    start_step: int = 0
    tensorboard: bool = True
    progress_bar: bool = True
    log_interval: int = 1
    """Steps between printed metric lines when there is no progress bar."""

    def __post_init__(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.samples_path = self.output_dir / "samples.jsonl"
        truncate_metrics(self.metrics_path, self.start_step)
        truncate_metrics(self.samples_path, self.start_step)
        self._failure_shown = False
        self._tb = self._open_tensorboard() if self.tensorboard else None
        self._bar = self._open_progress_bar() if self.progress_bar else None

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("reporting: tensorboard is not installed; metrics go to metrics.jsonl only")
            return None
        # purge_step: on resume, events at steps > start_step (written after the checkpoint) are discarded
        purge_step = self.start_step + 1 if self.start_step > 0 else None
        return SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=purge_step)

    def _open_progress_bar(self):
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, desc="RL steps", dynamic_ncols=True)

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append the step's metrics to the JSONL file and TensorBoard, advance the bar with live reward/loss."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._bar is None and step % self.log_interval == 0:
            print(f"step {step}/{self.total_steps}  reward {metrics.get(REWARD_KEY, float('nan')):.3f}  "
                  f"loss {metrics.get(LOSS_KEY, float('nan')):.4f}", flush=True)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics.get(REWARD_KEY, float('nan')):.3f}",
                                  loss=f"{metrics.get(LOSS_KEY, float('nan')):.4f}")
            self._bar.update(1)

    def log_samples(self, step: int, split: str, samples: Sequence[Sample]) -> None:
        """Append decoded samples to ``samples.jsonl`` (one whole line each) and TensorBoard text."""
        if not samples:
            return
        records = [{"step": step, "split": split, **sample_record(sample)} for sample in samples]
        with self.samples_path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        if self._tb is not None:  # markdown: line breaks, and the template's <markers> shown, not taken as HTML
            text = "\n\n".join(format_sample(r).replace("<", "&lt;").replace(">", "&gt;").replace("\n", "  \n")
                                for r in records)
            self._tb.add_text(f"samples/{split}", text, step)
            self._tb.flush()

    def note_failures(self, failures: Sequence[SampleFailure], what: str) -> None:
        """Print the run's first failed sample, once, in one line (the count goes to every metrics row); its
        traceback, when known, goes to ``FAILURE_FILE`` in the output directory, once."""
        if failures and not self._failure_shown:
            self._failure_shown = True
            first = failures[0]
            kept = ""
            if first.traceback:
                path = self.output_dir / FAILURE_FILE
                atomic_write_text(path, f"{first.line(what)}\n\n{first.traceback}")
                kept = f"; its traceback is in {path}"
            self.write(f"megatron_rl: {first.line(what)}; the sample is left out of training and the run goes "
                       f"on (each step counts them in {FAILED_KEY}; this message is shown once{kept})")

    def write(self, message: str) -> None:
        """Print without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def finish(self, *, baseline: float | None, times: WallTimes) -> str:
        """Close the bar and writers, save the plot and the summary; returns the summary paragraph."""
        self.close()
        rows = read_metrics(self.metrics_path)
        plot_reward_and_loss(rows, self.output_dir / "reward_loss.png", baseline=baseline)
        summary = summary_paragraph(rows, baseline=baseline, times=times)
        quoted = read_metrics(self.samples_path)[-SUMMARY_SAMPLES:]
        if quoted:
            summary += f"\n\nThe last {len(quoted)} samples (all in {self.samples_path.name}):\n" + \
                "\n".join(format_sample(r) for r in quoted)
        atomic_write_text(self.output_dir / "summary.txt", summary + "\n")
        return summary

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
