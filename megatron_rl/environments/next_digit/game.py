"""The toy multi-turn environment of the default config: the "next digit" game.

Place in the data flow: ``rollout.py`` (this package) plays many episodes of this game in lock-step with the sampler and
turns them into a ``GeneratorOutput`` (one sequence per turn) for ``Trainer.train_step``.

The game, with ``offset`` k (default 1) and ``num_turns`` turns (default 3)::

    turn 1 prompt   <bos> d1 ?
    policy          a1 <eos>                  right answer: a1 = (d1 + k) mod 10, then the stop token
    turn 2 prompt   <bos> d1 ? a1 <eos> f1 d2 ?          f1 = "+" if turn 1 was right, else "-"
    policy          a2 <eos>
    ...

Each turn's prompt is the previous prompt + response + an observation (feedback and the next digit), so a
trajectory's steps share prefixes: exactly what step-wise training and prefix merging (docs/DESIGN.md section 6)
consume. The reward, given at the end of the episode, is the mean turn score in [0, 1]::

    turn score = 0.5 * [first response token is the right digit] + 0.5 * [response == (right digit, <eos>)]

A uniformly random policy over the 16-token vocabulary scores about 0.03; a randomly initialized model about
the same. The mapping "digit -> digit + k" is learnable by a tiny transformer with RL alone in a few minutes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer


@dataclass
class Episode:
    """One game: the hidden digits, and per turn the prompt the policy saw, its response and the turn score."""

    digits: list[int]
    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.responses) == len(self.digits)

    @property
    def current_prompt(self) -> list[int]:
        """The prompt of the turn being played (the last one after the game ended)."""
        return self.prompts[-1]

    @property
    def reward(self) -> float:
        """Mean turn score, in [0, 1]; defined once the game is over."""
        assert self.done, "reward of an unfinished episode"
        return sum(self.scores) / len(self.scores)


class NextDigitGame:
    """Builds prompts and observations and scores responses of the next-digit game (see the module docstring)."""

    def __init__(self, tokenizer: DigitTokenizer, *, num_turns: int = 3, offset: int = 1) -> None:
        if num_turns < 1:
            raise ValueError(f"next_digit.num_turns={num_turns} must be >= 1")
        self.tok = tokenizer
        self.num_turns = num_turns
        self.offset = offset

    def new_episode(self, rng: random.Random) -> Episode:
        """A fresh game with random digits; its first prompt is ``<bos> d1 ?``."""
        digits = [rng.randrange(10) for _ in range(self.num_turns)]
        first_prompt = [self.tok.bos_token_id, self.tok.digit_id(digits[0]), self.tok.ask_token_id]
        return Episode(digits=digits, prompts=[first_prompt])

    def copy_episode(self, episode: Episode) -> Episode:
        """An unplayed game with the same digits (the n samples of one prompt play the same game)."""
        return Episode(digits=list(episode.digits), prompts=[list(episode.prompts[0])])

    def target_digit(self, shown_digit: int) -> int:
        return (shown_digit + self.offset) % 10

    def turn_score(self, shown_digit: int, response: list[int]) -> float:
        """0.5 for the right first token, another 0.5 when the response is exactly (right digit, <eos>)."""
        target = self.tok.digit_id(self.target_digit(shown_digit))
        first_right = len(response) > 0 and response[0] == target
        exact = response == [target, self.tok.eos_token_id]
        return 0.5 * first_right + 0.5 * exact

    def step(self, episode: Episode, response: list[int]) -> None:
        """Record the policy's response to the current turn; if the game goes on, append the next prompt."""
        assert not episode.done, "step on a finished episode"
        turn = len(episode.responses)
        score = self.turn_score(episode.digits[turn], response)
        episode.responses.append(list(response))
        episode.scores.append(score)
        if not episode.done:
            feedback = self.tok.correct_token_id if score == 1.0 else self.tok.wrong_token_id
            observation = [feedback, self.tok.digit_id(episode.digits[turn + 1]), self.tok.ask_token_id]
            episode.prompts.append(episode.current_prompt + list(response) + observation)
