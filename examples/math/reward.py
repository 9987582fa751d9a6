"""Reward for math word problems with a numeric answer (e.g. GSM8K as JSONL: ``{"prompt": ..., "answer": "42"}``).

Called by the main job as ``reward(prompt=..., response=..., answer=...)``: 1.0 when the last number in the
response equals ``answer`` (GSM8K's ``#### 42`` form is accepted in the column), else 0.0; ``has_number`` is
logged as ``reward_fn/has_number``.
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reward(prompt: str, response: str, answer: str, **_: object) -> dict[str, float]:
    target = _value(str(answer).split("####")[-1])
    got = _value(response)
    return {"reward": float(got is not None and target is not None and abs(got - target) < 1e-6),
            "has_number": float(got is not None)}
