"""Reward of the image demo: the response must name the picture's square count, then stop.

Called by the main job as ``reward(prompt=..., response=..., answer=..., images=..., count=...)`` (columns of
the JSONL files; ``answer`` is the count as a word): 1.0 for exactly the answer, 0.5 when the first word is the
answer but more follows, else 0.0. ``first_word_right`` is logged as ``reward_fn/first_word_right``.
"""


def reward(prompt: str, response: str, answer: str, **_: object) -> dict[str, float]:
    words = response.split()
    first_right = float(bool(words) and words[0] == answer)
    exact = float(words == [answer])
    return {"reward": 0.5 * first_right + 0.5 * exact, "first_word_right": first_right}
