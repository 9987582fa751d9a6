"""Samples that failed: left out of training without killing the run (a reward function, environment or agent
that raised on one row).

Place in the data flow: inside an environment's ``rollout``, between scoring and ``Rollouts``::

    score each sample (catch the exception -> SampleFailure)  ->  drop_failed_samples(output, failed)
      ->  Rollouts(output, metrics | failure metrics, failures)  ->  job/main.py prints the first failure once
                                                                    ->  Trainer.train_step

Interface for an environment (``single_turn`` uses it directly; the multi-turn ones, ``step_api`` and ``agent``,
through ``assemble_episodes``, which does steps 1-3 for episodes of step-wise rows):

1. build the step's ``GeneratorOutput`` as usual, giving a failed sample any finite reward (0.0) and at least
   one row (the turns it played before failing): a group whose samples all failed stays in the batch as one
   of those rows, so the rows are needed even though they are never trained on;
2. ``failed[i]`` per sequence (True where sample i raised; step-wise, one failed turn fails its trajectory);
3. ``output, metrics = drop_failed_samples(output, failed)``; put ``metrics`` and the ``SampleFailure`` records
   (``failure(index, row, err)``) into ``Rollouts``. When every sample failed it raises ``AllSamplesFailed``:
   the main job stops with one line, keeping the last checkpoint.

What happens to the batch (and why): a failed trajectory is removed from its group (its rows are gone, so the
group baseline of GRPO/RLOO is the mean over the samples that did get a reward). A group left with fewer than
``min_group_size`` (2) trajectories has no baseline to learn from: it is *dropped from training* but keeps one
placeholder trajectory (its first, ``loss_masks`` all 0, reward 0), so the batch still holds
``batch.train_batch_size`` prompts. The trainer counts mini-batches in prompts (``data/minibatch.py``): a batch
with fewer prompts would take fewer optimizer steps than the LR schedule counts on, or not divide into
mini-batches at all. The placeholder carries no gradient: its advantage is 0 (a singleton group with reward 0)
and no token of it is in any loss; with ``loss_reduction: token_mean`` (the default) the step's gradient is
exactly that of the batch without it. With ``sequence_mean`` it still counts as a row of its mini-batch (as a
zero-advantage group does), the same on every DP split. The trainer's ``reward/*`` metrics skip rows without
loss tokens, so placeholders do not pull ``reward/mean`` down.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rl.data.generator_output import PER_SEQUENCE_FIELDS, GeneratorOutput, is_scalar_reward

FAILED_SAMPLES = "rollout/failed_samples"
"""Metric: samples (trajectories) of the step whose scoring raised (0 when none)."""
DROPPED_GROUPS = "rollout/dropped_groups"
"""Metric: groups (prompts) left out of training because fewer than two of their samples survived."""


@dataclass(frozen=True)
class SampleFailure:
    """One failed sample, for the one line the job prints (the first of the run) and for samples.jsonl."""

    index: int
    """Position of the sample among the step's samples."""
    row: int | None
    """The data row it came from (e.g. its prompt's row in ``data.train_files``), None when there is none."""
    error: str
    """``ExceptionType: message``, one line."""
    where: str | None = None
    """``file.py:line`` of the user's code that raised (the innermost frame outside megatron_rl, the standard
    library and site-packages), None when it is not known."""
    traceback: str | None = None
    """The whole traceback (the job writes the run's first one to its folder: ``RunReporter.note_failures``)."""

    def line(self, what: str) -> str:
        where = f"row {self.row}" if self.row is not None else f"sample {self.index}"
        return f"{what} failed on {where}: {self.error}" + (f" (at {self.where})" if self.where else "")


def failure(index: int, row: int | None, err: BaseException | str, *,
            raised: BaseException | None = None) -> SampleFailure:
    """A ``SampleFailure`` from a caught exception, or a message that already says what raised (on one line, at
    most 300 characters); ``raised``: the exception behind such a message, whose traceback is kept."""
    message = " ".join(str(err).split())
    message = message if len(message) <= 300 else message[:297] + "..."
    if isinstance(err, BaseException):
        message = f"{type(err).__name__}: {message}" if message else type(err).__name__
    source = err if isinstance(err, BaseException) else raised
    where, text = raised_at(source) if source is not None else (None, None)
    return SampleFailure(index, row, message, where, text)


def raised_at(err: BaseException) -> tuple[str | None, str]:
    """``(file.py:line, traceback text)`` of the exception at the root of ``err``'s chain (``raise ... from``:
    a wrapper such as the step API's ``EpisodeError`` names the call, its cause holds the user's frames)."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    frames = traceback.extract_tb(root.__traceback__)
    ours = tuple(str(p) for p in (Path(__file__).resolve().parents[1], *_library_paths()))
    user = [f for f in frames if not f.filename.startswith(ours) and not f.filename.startswith("<")]
    frame = user[-1] if user else (frames[-1] if frames else None)
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else None
    return where, "".join(traceback.format_exception(err))


def _library_paths() -> set[str]:
    """The standard library's and the installed packages' folders (not the user's code)."""
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    return found | {os.path.realpath(path) for path in found}  # a venv reached through a symbolic link


class AllSamplesFailed(Exception):
    """Every sample of a step failed: nothing to train on. The message names the first failure."""


def _trajectories(output: GeneratorOutput) -> list[list[int]]:
    """Row indices of each trajectory, in order (one row each when there are no trajectory ids)."""
    ids = output.get("trajectory_ids")
    if ids is None:
        return [[i] for i in range(len(output["uids"]))]
    runs: list[list[int]] = []
    for i, tid in enumerate(ids):
        if runs and ids[runs[-1][0]] == tid:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _groups(output: GeneratorOutput, trajectories: list[list[int]]) -> list[list[list[int]]]:
    """Trajectories grouped by their (contiguous) uid."""
    uids: list[Hashable] = output["uids"]
    groups: list[list[list[int]]] = []
    for rows in trajectories:
        if groups and uids[groups[-1][0][0]] == uids[rows[0]]:
            groups[-1].append(rows)
        else:
            groups.append([rows])
    return groups


def drop_failed_samples(output: GeneratorOutput, failed: Sequence[bool], *, min_group_size: int = 2
                        ) -> tuple[GeneratorOutput, dict[str, float]]:
    """``output`` without its failed trajectories, and the failure metrics (module docstring).

    ``failed``: one flag per sequence. Returns a new ``GeneratorOutput`` (``output`` is not modified) and
    ``{FAILED_SAMPLES: n, DROPPED_GROUPS: g}``. Raises ``AllSamplesFailed`` when every trajectory failed.
    """
    assert len(failed) == len(output["uids"]), (len(failed), len(output["uids"]))
    trajectories = _trajectories(output)
    bad = [any(failed[i] for i in rows) for rows in trajectories]
    metrics = {FAILED_SAMPLES: float(sum(bad)), DROPPED_GROUPS: 0.0}
    if not any(bad):
        return output, metrics
    if all(bad):
        raise AllSamplesFailed(f"all {len(bad)} samples of the step failed")
    bad_of = {id(rows): b for rows, b in zip(trajectories, bad)}
    keep: list[int] = []
    placeholders: set[int] = set()
    for group in _groups(output, trajectories):
        survivors = [rows for rows in group if not bad_of[id(rows)]]
        if len(survivors) >= min(min_group_size, len(group)):
            keep += [i for rows in survivors for i in rows]
        else:
            metrics[DROPPED_GROUPS] += 1
            keep += group[0]
            placeholders.update(group[0])
    return _select(output, keep, placeholders), metrics


def _select(output: GeneratorOutput, keep: list[int], placeholders: set[int]) -> GeneratorOutput:
    """Rows ``keep`` of every per-sequence field; rows in ``placeholders`` get loss mask 0 and reward 0."""
    out = dict(output)
    for name in PER_SEQUENCE_FIELDS:
        if output.get(name) is not None:
            out[name] = [output[name][i] for i in keep]
    for j, i in enumerate(keep):
        if i in placeholders:
            out["loss_masks"][j] = [0] * len(output["loss_masks"][i])
            reward = output["rewards"][i]
            out["rewards"][j] = 0.0 if is_scalar_reward(reward) else [0.0] * len(reward)
    return out  # type: ignore[return-value]


@dataclass
class EpisodeRows:
    """One multi-turn episode of the step, as ``assemble_episodes`` takes it."""

    rows: list[dict]
    """Its step-wise rows (``conversation.py: trajectory_rows``: one per turn, the reward on the last); empty when it
    failed before its first turn."""
    uid: Hashable
    """Its group (the row's index in the step)."""
    trajectory_id: Hashable
    failed: bool


def assemble_episodes(episodes: Sequence[EpisodeRows], *, pad_token_id: int, eos_token_id: int, what: str,
                      first_failure: str | None, teacher_ids: Mapping[Hashable, int] | None = None
                      ) -> tuple[GeneratorOutput, dict[str, float]]:
    """The step's ``GeneratorOutput`` from its episodes (step API and agent alike): an episode without rows gets
    one ``placeholder_row`` (every sample needs a row, see the module docstring), the rows are concatenated in
    order and the failed episodes left out (``drop_failed_samples``). ``what`` (e.g. ``job.agent='a.py:f'``) and
    ``first_failure`` (its line) word the ``AllSamplesFailed`` of a step where every episode failed.
    ``teacher_ids``: uid -> the distillation teacher of the group's data row (``distillation/routing.py``), written
    to every sequence of the group as ``GeneratorOutput['teacher_ids']``; None: no routing."""
    routing = routing_shape([episode.rows for episode in episodes])
    images = any("images" in row for episode in episodes for row in episode.rows)
    rows = [episode.rows or [placeholder_row(episode.uid, episode.trajectory_id, pad_token_id, eos_token_id, routing,
                                             images)] for episode in episodes]
    output = {name: [row[name] for episode_rows in rows for row in episode_rows] for name in rows[0][0]}
    failed = [episode.failed for episode, episode_rows in zip(episodes, rows) for _ in episode_rows]
    try:
        output, metrics = drop_failed_samples(output, failed)  # type: ignore[arg-type]
    except AllSamplesFailed as err:
        raise AllSamplesFailed(f"{err}: every episode of {what} failed; first: {first_failure}") from None
    if teacher_ids is not None:  # on-policy distillation: every step of a trajectory has its row's teacher
        output["teacher_ids"] = [teacher_ids[uid] for uid in output["uids"]]
    return output, metrics


def placeholder_row(uid: Hashable, trajectory_id: Hashable, pad_token_id: int, eos_token_id: int,
                    routing: tuple[int, ...] | None, images: bool = False) -> dict:
    """The one row of a failed episode that played no turn (a step-API ``reset`` that raised, an agent that made
    no call): ``drop_failed_samples`` needs a row per sample (it keeps one, masked, of a group whose samples all
    failed). A pad token as prompt, the eos as response, reward 0, loss mask 0: never trained on. ``routing``:
    ``(L, k)`` when the played rows carry ``routed_experts`` (MoE routing replay R3 needs them on every row): the
    placeholder's are all zeros. ``images``: the played rows carry ``images`` (a vision-language model): none."""
    row = {"prompt_token_ids": [pad_token_id], "response_ids": [eos_token_id], "rewards": 0.0, "loss_masks": [0],
           "uids": uid, "rollout_logprobs": [0.0], "trajectory_ids": trajectory_id, "is_last_step": True,
           "stop_reasons": "stop"}
    if routing is not None:
        row["routed_experts"] = np.zeros((2, *routing), dtype=np.int64)
    if images:
        row["images"] = []
    return row


def routing_shape(played: Sequence[Sequence[dict]]) -> tuple[int, ...] | None:
    """``(L, k)`` of the played rows' ``routed_experts`` ``[p + r, L, k]``, None when they have none."""
    first = next((row["routed_experts"] for rows in played for row in rows if "routed_experts" in row), None)
    return None if first is None else tuple(np.shape(first)[1:])
