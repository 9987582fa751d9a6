"""Where a run's start-up seconds went: marks taken by the main job as it starts, split into named phases for
the summary's wall-time line (``reporting.py: WallTimes``) and rank 0's "started in" line.

Place in the data flow: ``job/main.py`` marks the end of each start-up phase on every rank (stdlib only, no
collective); rank 0's marks are the ones reported. The phases, in order:

    launch        from ``run_megatron.sh``'s start (``$MEGATRON_RL_LAUNCH_TIME``) to this rank's process start:
                  the pre-flight (a config check in its own process) and torchrun
    imports       this process's start to its config read and environment made (Python, torch, megatron_rl,
                  the data and the reward function's check)
    distributed   the process groups (gloo/NCCL rendezvous) and seeds
    model         the policy (random, or read from ``model.hf_path``), the reference, the critic, the trainer
    resume        the newest checkpoint read (nothing to read: ~0)
    engine        the rollout engine started on the policy's weights (vLLM: its server's boot and first sync)

A phase not reached (a run that stops early) is left out.
"""

from __future__ import annotations

import time

PHASES = ("imports", "distributed", "model", "resume", "engine")
_marks: dict[str, float] = {}


def mark(phase: str) -> None:
    """``phase`` (one of ``PHASES``) ended now."""
    assert phase in PHASES, phase
    _marks[phase] = time.time()


def split(launched: float, process_started: float, marks: dict[str, float] | None = None) -> list[tuple[str, float]]:
    """``[(phase, seconds)]`` from the launch through the last phase marked."""
    marks = _marks if marks is None else marks
    parts, before = [("launch", max(0.0, process_started - launched))], process_started
    for phase in PHASES:
        if phase in marks:
            parts.append((phase, max(0.0, marks[phase] - before)))
            before = marks[phase]
    return parts


def phrase(parts: list[tuple[str, float]]) -> str:
    """``launch 2.1 s, imports 4.0 s, ...`` (the order of ``split``)."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts)
