"""The next-digit game's tokenizer: a tiny fixed vocabulary, one token per symbol, no downloads.

Place in the data flow: the environment (``game.py``) writes prompts and reads responses as token ids
of this vocabulary; the sampler and the trainer only ever see ids. ``decode`` exists for humans (logs, tests).

    id  0      1      2      3      4      5      6..15
        <pad>  <bos>  <eos>  ?      +      -      0 .. 9

``?`` asks the policy for an answer, ``+`` / ``-`` are the environment's feedback on the previous answer, ``<eos>``
is the stop token that ends a response.
"""

from __future__ import annotations

from collections.abc import Sequence

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "?", "+", "-")
DIGITS = tuple(str(d) for d in range(10))


class DigitTokenizer:
    """Integer tokenizer over ``SPECIAL_TOKENS + DIGITS`` (vocab size 16, a multiple of common TP sizes)."""

    def __init__(self) -> None:
        self.tokens: tuple[str, ...] = SPECIAL_TOKENS + DIGITS
        self._ids = {tok: i for i, tok in enumerate(self.tokens)}
        self.pad_token_id = self._ids["<pad>"]
        self.bos_token_id = self._ids["<bos>"]
        self.eos_token_id = self._ids["<eos>"]
        self.ask_token_id = self._ids["?"]
        self.correct_token_id = self._ids["+"]
        self.wrong_token_id = self._ids["-"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def digit_id(self, digit: int) -> int:
        """Token id of the digit ``0 <= digit <= 9``."""
        assert 0 <= digit <= 9, digit
        return self._ids[str(digit)]

    def id_to_digit(self, token_id: int) -> int | None:
        """The digit a token id stands for, or None for a non-digit token."""
        if 0 <= token_id < self.vocab_size and self.tokens[token_id] in DIGITS:
            return int(self.tokens[token_id])
        return None

    def encode(self, symbols: Sequence[str]) -> list[int]:
        """Ids of a sequence of symbols, e.g. ``["<bos>", "3", "?"]``."""
        unknown = [s for s in symbols if s not in self._ids]
        if unknown:
            raise ValueError(f"unknown next-digit symbols {unknown}; the vocabulary is {list(self.tokens)}")
        return [self._ids[s] for s in symbols]

    def decode(self, ids: Sequence[int]) -> str:
        """Space-separated symbols; ids outside the vocabulary (a model vocab padded for TP) print as ``<id>``."""
        return " ".join(self.tokens[i] if 0 <= i < self.vocab_size else f"<{i}>" for i in ids)
