"""Moved to ``megatron_rl/environments/next_digit/tokenizer.py``; names re-exported."""

from megatron_rl.environments.next_digit.tokenizer import DIGITS, SPECIAL_TOKENS, DigitTokenizer  # noqa: F401
