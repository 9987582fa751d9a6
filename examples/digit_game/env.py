"""The next-digit game (megatron_rl/environments/next_digit/game.py) as a step-API environment: the same rules in
a user's class, run by the job (docs/JOB.md "A multi-turn environment of your own"). One row of games.jsonl is
one game, its `digits`; each turn shows a digit and asks for it plus `offset` (mod 10), then answers + or -.
The episode's reward (the sum of the turns') is the built-in game's: the mean turn score, where a turn scores
0.5 for the right first word and 0.5 more for exactly the right digit (then the stop token).

    .venv/bin/python examples/digit_game/make_model.py outputs/digit_game_model
    CONFIG=configs/digit_game_cpu.yaml bash run_megatron.sh
"""


class DigitGame:
    def __init__(self, digits: list[int], offset: int = 1):
        self.digits, self.offset, self.turn = digits, offset, 0

    def reset(self) -> str:
        return f"{self.digits[0]} ?"  # the tokenizer has no chat template: raw text, as the built-in game

    def step(self, response: str):
        words, target = response.split(), str((self.digits[self.turn] + self.offset) % 10)
        score = 0.5 * (words[:1] == [target]) + 0.5 * (words == [target])
        self.turn += 1
        done = self.turn == len(self.digits)
        observation = None if done else f"{'+' if score == 1.0 else '-'} {self.digits[self.turn]} ?"
        return observation, score / len(self.digits), done
