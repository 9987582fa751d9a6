"""Play the next-digit game with a rollout engine and package the episodes as a ``GeneratorOutput``.

Place in the data flow: the first stage of every RL step of the main job (``environment.py`` of this package)::

    play_episodes (game + engine, all turns in lock-step)  ->  episodes_to_generator_output  ->  Trainer.train_step

``num_prompts`` games are drawn, each played ``n_samples_per_prompt`` times (one GRPO group per game: same digits,
uid = the game's index). Two layouts of the same episodes:

- step-wise (``step_wise=True``): one sequence per turn, prompt = that turn's prompt (the whole history), reward
  0 on all but the last turn, which carries the episode reward; trajectory ids and ``is_last_step`` set.
- trajectory (``step_wise=False``): one sequence per episode, prompt = the first turn's prompt, response = every
  response and observation in order, observations with loss mask 0 and log-prob 0. This is exactly what prefix
  merging (``merge_stepwise_output``) makes of the step-wise layout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.data.generator_output import GeneratorOutput
from megatron_rl.environments.next_digit.game import Episode, NextDigitGame
from megatron_rl.inference.engine import RolloutEngine, SamplingSpec


@dataclass
class PlayedEpisode:
    """An episode with what the sampler recorded for each turn."""

    episode: Episode
    uid: int
    """Index of the game (GRPO group) in the batch."""
    sample_index: int
    logprobs: list[list[float]]
    stop_reasons: list[str]


def play_episodes(
    game: NextDigitGame,
    engine: RolloutEngine,
    spec: SamplingSpec,
    *,
    num_prompts: int,
    n_samples_per_prompt: int,
    rng: random.Random,
    seed: int,
) -> list[PlayedEpisode]:
    """Draw ``num_prompts`` games (digits from ``rng``), play each ``n_samples_per_prompt`` times; all episodes
    advance turn by turn, one ``engine.generate`` call per turn, every call with ``seed`` (the built-in engine
    continues one random stream across the turns). Collective when the engine is."""
    played = []
    for uid in range(num_prompts):
        template = game.new_episode(rng)
        for k in range(n_samples_per_prompt):
            played.append(PlayedEpisode(game.copy_episode(template), uid, k, [], []))
    for _ in range(game.num_turns):
        completions = engine.generate([p.episode.current_prompt for p in played], spec, seed=seed)
        for p, completion in zip(played, completions):
            game.step(p.episode, completion.token_ids)
            p.logprobs.append(completion.logprobs)
            p.stop_reasons.append(completion.finish_reason)
    return played


def episodes_to_generator_output(played: list[PlayedEpisode], *, step_wise: bool) -> GeneratorOutput:
    """The rollouts of ``played`` in the step-wise or the trajectory layout (see the module docstring)."""
    rows = [row for p in played for row in (_step_rows(p) if step_wise else [_trajectory_row(p)])]
    out: GeneratorOutput = {name: [row[name] for row in rows] for name in rows[0]}  # type: ignore[assignment]
    return out


def mean_reward(played: list[PlayedEpisode]) -> float:
    return sum(p.episode.reward for p in played) / len(played)


def _step_rows(p: PlayedEpisode) -> list[dict]:
    ep = p.episode
    num_turns = len(ep.responses)
    return [
        {
            "prompt_token_ids": ep.prompts[t],
            "response_ids": ep.responses[t],
            "rewards": ep.reward if t == num_turns - 1 else 0.0,
            "loss_masks": [1] * len(ep.responses[t]),
            "uids": p.uid,
            "rollout_logprobs": p.logprobs[t],
            "trajectory_ids": (p.uid, p.sample_index),
            "is_last_step": t == num_turns - 1,
            "stop_reasons": p.stop_reasons[t],
        }
        for t in range(num_turns)
    ]


def observation_after(ep: Episode, turn: int) -> list[int]:
    """Tokens the environment appended after the response of ``turn`` (empty after the last turn)."""
    if turn + 1 >= len(ep.prompts):
        return []
    start = len(ep.prompts[turn]) + len(ep.responses[turn])
    return ep.prompts[turn + 1][start:]


def _trajectory_row(p: PlayedEpisode) -> dict:
    ep = p.episode
    response, loss_mask, logprobs = [], [], []
    for t, turn_response in enumerate(ep.responses):
        observation = observation_after(ep, t)
        response += turn_response + observation
        loss_mask += [1] * len(turn_response) + [0] * len(observation)
        logprobs += p.logprobs[t] + [0.0] * len(observation)
    return {
        "prompt_token_ids": ep.prompts[0],
        "response_ids": response,
        "rewards": ep.reward,
        "loss_masks": loss_mask,
        "uids": p.uid,
        "rollout_logprobs": logprobs,
        "trajectory_ids": (p.uid, p.sample_index),
        "is_last_step": True,
        "stop_reasons": p.stop_reasons[-1],
    }
