"""Reward of the arithmetic example: the response must be the answer's digit, then stop.

Called by the main job as ``reward(prompt=..., response=..., answer=...)`` (``answer`` is a column of the JSONL
files): 1.0 for exactly the answer, 0.5 when the first word is right but more follows, else 0.0. The dict's
other entries are logged as ``reward_fn/first_word_right``.
"""


def reward(prompt: str, response: str, answer: str, **_: object) -> dict[str, float]:
    words = response.split()
    first_right = float(bool(words) and words[0] == str(answer))
    exact = float(words == [str(answer)])
    return {"reward": 0.5 * first_right + 0.5 * exact, "first_word_right": first_right}
