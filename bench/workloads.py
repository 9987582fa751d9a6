"""Synthetic rollout workloads shared by the benchmarks in ``bench/`` (not a test, not part of the package).

Place in the data flow (docs/DESIGN.md section 1): these stand in for the generator; every workload is a valid
``GeneratorOutput`` (plain lists) that enters the pipeline at validation / ``merge_stepwise_output``.

Step-wise workload (``stepwise_workload``): ``num_trajectories`` trajectories of ``turns`` turns each, grouped
``samples_per_prompt`` trajectories per prompt (uid). Turn ``t`` of a trajectory is one sequence:

    prompt_0   = initial prompt                     length ~ U[prompt_len]
    response_t = generated tokens                   length ~ max(min_response_len, U[response_len] * decay**t)
    obs_t      = observation after response_{t-1}   length ~ U[observation_len]
    prompt_t   = prompt_{t-1} + response_{t-1} + obs_t        (the history grows by one exchange per turn)

so prompt lengths grow with the turn while response lengths shrink: prompt and response lengths are
anti-correlated, the case where the old two-segment layout ``max(p) + max(r)`` wastes the most. Because each
prompt extends the previous prompt + response, ``merge_stepwise_output`` merges each trajectory into one
sequence: ``sum_t (p_t + r_t)`` tokens, which grows as O(T^2), become the final context ``p_T + r_T``, O(T).
The reward (1.0 or 0.0, a coin flip) sits on each trajectory's last step; loss masks are all ones.

Non-step-wise workload (``independent_workload``): single-turn sequences whose total length is
``mean_len +- jitter`` and whose prompt takes a uniform share of it, so long prompts come with short
responses (anti-correlated again); ``samples_per_prompt`` consecutive sequences share a uid.

Token ids are drawn from ``[1, vocab_size)`` (0 is left free for padding). Deterministic under ``seed``.

Also here, shared by every benchmark: ``check`` (a benchmark's own sanity checks raise ``SanityCheckFailed``,
which its ``main`` turns into a non-zero exit) and ``markdown_table``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_rl.data import GeneratorOutput


@dataclass(frozen=True, kw_only=True)
class StepWiseSpec:
    """Parameters of ``stepwise_workload`` (inclusive integer ranges ``(low, high)``)."""

    num_trajectories: int = 16
    """Trajectories in the batch."""
    turns: int = 4
    """Turns (sequences) per trajectory."""
    samples_per_prompt: int = 4
    """Consecutive trajectories sharing one uid (the GRPO group)."""
    prompt_len: tuple[int, int] = (64, 192)
    """Initial prompt length range."""
    response_len: tuple[int, int] = (128, 256)
    """First-turn response length range."""
    response_decay: float = 0.6
    """Each later turn's response length is multiplied by this (responses shrink as the history grows)."""
    min_response_len: int = 8
    """Floor of the response length."""
    observation_len: tuple[int, int] = (16, 48)
    """Observation (environment reply) length range, appended to the history before each later turn."""
    vocab_size: int = 32000
    """Token ids are drawn from [1, vocab_size)."""
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class IndependentSpec:
    """Parameters of ``independent_workload``."""

    num_sequences: int = 64
    mean_len: int = 512
    """Mean of prompt + response length."""
    jitter: int = 64
    """Total length is mean_len +- jitter (uniform)."""
    min_segment: int = 16
    """Smallest prompt and smallest response."""
    samples_per_prompt: int = 4
    vocab_size: int = 32000
    seed: int = 0


def _length(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(1, vocab_size, n).tolist()


def _empty_output() -> dict[str, list]:
    keys = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs", "uids",
            "trajectory_ids", "is_last_step")  # fmt: skip
    return {k: [] for k in keys}


def _append(out: dict[str, list], prompt: list[int], response: list[int], reward: float, uid: int,
            trajectory_id: tuple[int, int], is_last: bool, rng: np.random.Generator) -> None:  # fmt: skip
    out["prompt_token_ids"].append(prompt)
    out["response_ids"].append(response)
    out["rewards"].append(reward)
    out["loss_masks"].append([1] * len(response))
    out["rollout_logprobs"].append((-rng.random(len(response))).tolist())
    out["uids"].append(uid)
    out["trajectory_ids"].append(trajectory_id)
    out["is_last_step"].append(is_last)


def _response_length(spec: StepWiseSpec, rng: np.random.Generator, turn: int) -> int:
    return max(spec.min_response_len, int(_length(rng, spec.response_len) * spec.response_decay**turn))


def stepwise_workload(spec: StepWiseSpec) -> GeneratorOutput:
    """``num_trajectories * turns`` sequences, trajectory-major (see the module docstring)."""
    if spec.num_trajectories % spec.samples_per_prompt != 0:
        raise ValueError(
            f"StepWiseSpec.num_trajectories={spec.num_trajectories} is not a multiple of "
            f"samples_per_prompt={spec.samples_per_prompt}; make it one (whole prompt groups)"
        )
    rng = np.random.default_rng(spec.seed)
    out = _empty_output()
    for traj in range(spec.num_trajectories):
        uid = traj // spec.samples_per_prompt
        reward = float(rng.integers(0, 2))
        history = _tokens(rng, _length(rng, spec.prompt_len), spec.vocab_size)
        for turn in range(spec.turns):
            response = _tokens(rng, _response_length(spec, rng, turn), spec.vocab_size)
            is_last = turn == spec.turns - 1
            _append(out, history, response, reward if is_last else 0.0, uid,
                    (uid, traj % spec.samples_per_prompt), is_last, rng)  # fmt: skip
            observation = _tokens(rng, _length(rng, spec.observation_len), spec.vocab_size)
            history = history + response + observation
    return out  # type: ignore[return-value]


def independent_workload(spec: IndependentSpec) -> GeneratorOutput:
    """``num_sequences`` single-turn sequences with anti-correlated prompt/response lengths."""
    if spec.mean_len - spec.jitter < 2 * spec.min_segment:
        raise ValueError(
            f"IndependentSpec.mean_len={spec.mean_len} - jitter={spec.jitter} leaves less than "
            f"2 * min_segment={2 * spec.min_segment} tokens; raise mean_len or lower jitter/min_segment"
        )
    rng = np.random.default_rng(spec.seed)
    out = _empty_output()
    for i in range(spec.num_sequences):
        total = spec.mean_len + int(rng.integers(-spec.jitter, spec.jitter + 1))
        prompt_len = int(rng.integers(spec.min_segment, total - spec.min_segment + 1))
        prompt = _tokens(rng, prompt_len, spec.vocab_size)
        response = _tokens(rng, total - prompt_len, spec.vocab_size)
        _append(out, prompt, response, float(rng.integers(0, 2)), i // spec.samples_per_prompt, i, True, rng)
    return out  # type: ignore[return-value]


def real_tokens(out: GeneratorOutput) -> int:
    """Non-padding tokens of the rows: ``sum_i (p_i + r_i)``."""
    return sum(map(len, out["prompt_token_ids"])) + sum(map(len, out["response_ids"]))


def unique_tokens(out: GeneratorOutput) -> int:
    """The physical minimum: each trajectory's final context counted once (``p_last + r_last``)."""
    return sum(
        len(p) + len(r) for p, r, last in zip(out["prompt_token_ids"], out["response_ids"], out["is_last_step"]) if last
    )


def trained_tokens(out: GeneratorOutput) -> int:
    """Loss-masked (trained-on) response tokens: the training signal, identical before and after merging."""
    return sum(map(sum, out["loss_masks"]))


class SanityCheckFailed(AssertionError):
    """A benchmark's own invariant does not hold (its numbers would be meaningless)."""


def check(condition: bool, what: str) -> None:
    """Raise ``SanityCheckFailed(what)`` unless ``condition``."""
    if not condition:
        raise SanityCheckFailed(what)


def print_report_or_exit(run: Callable[[], dict]) -> dict:
    """Run a benchmark, print its ``report``; exit 1 (stderr message) if one of its sanity checks failed."""
    try:
        result = run()
    except SanityCheckFailed as err:
        print(f"SANITY CHECK FAILED: {err}", file=sys.stderr)
        sys.exit(1)
    print(result["report"])
    return result


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are printed as given (format them before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
