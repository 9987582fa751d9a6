"""A word-level tokenizer with chat templates (no downloads), and a scripted rollout engine, for the multi-turn
tests: ``Conversation`` (test_conversation.py) and the step-API environment (test_step_api.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_rl.inference.engine import Completion, SamplingSpec

WORDS = ["<pad>", "<unk>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "user", "assistant", "tool",
         *(str(d) for d in range(10)), "?", "+", "-"]
"""``<|im_end|>`` (id 2) is the eos; ``<think>`` and ``</think>`` are ordinary words, as in Qwen3."""

KEEP_HISTORY = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
"""Renders every message as it is: each prompt extends the previous one."""

STRIP_REASONING = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m.content %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].strip() %}{% endif %}"
    "<|im_start|> {{ m.role }} {{ c }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
"""Qwen3's rule: an assistant turn before the last user message loses its ``<think>...</think>`` block (tool
results after it do not count as user messages, so reasoning within a tool loop is kept)."""


def save_chat_tokenizer(path: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return path


def chat_tokenizer(path: Path, template: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_chat_tokenizer(path, template), local_files_only=True)


class ScriptedEngine:
    """A ``RolloutEngine`` whose reply to a prompt is ``reply(prompt text)`` (words), with made-up log-probs;
    records every call."""

    def __init__(self, tokenizer, reply: Callable[[str], str], version_of_call: Callable[[int], int] | None = None
                 ) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.calls: list[list[list[int]]] = []
        self.version_of_call = version_of_call
        """Label each call's tokens with this weight version, as vLLM does with partial rollouts."""

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int) -> list[Completion]:
        self.calls.append([list(p) for p in prompts])
        completions = []
        for prompt in prompts:
            ids = self.tokenizer(self.reply(self.tokenizer.decode(list(prompt))), add_special_tokens=False)["input_ids"]
            ids = ids[:spec.max_tokens]
            stopped = bool(ids) and ids[-1] in spec.stop_token_ids
            extra = {} if self.version_of_call is None else {
                "weight_versions": [self.version_of_call(len(self.calls) - 1)] * len(ids)}
            completions.append(Completion(ids, [-0.5] * len(ids), "stop" if stopped else "length", extra))
        return completions

    def update_weights(self, policy) -> float:
        return 0.0

    def close(self) -> None:
        pass
