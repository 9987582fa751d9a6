"""Write a tiny random Qwen3 with a chat template that renders tools into a folder (no downloads): the model of
the tool-agent example (examples/tool_agent/agent.py, configs/tool_agent_cpu.yaml).

    python examples/tool_agent/make_model.py outputs/tool_agent_model [--seed 0]

The tokenizer is a byte-level BPE (any text encodes, and decoding gives the text back) trained here on a few
lines, with ChatML turns (``<|im_start|>``, ``<|im_end|>``, the eos) and ``<tool_call>``/``</tool_call>`` as
single tokens. Its template is Qwen's layout in short: the tools' JSON schemas in a system turn, assistant tool
calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what ``rollout.tool_call_parser=hermes``
reads), tool results as ``tool`` turns. The model is random: it shows the mechanics, it does not know the task.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "{{ 'Tools:' }}{% for tool in tools %}{{ ' ' + tool | tojson }}{% endfor %}"
    "{{ '\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "{{ '<|im_start|>' + m.role + '\\n' }}{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Every assistant turn renders as the text the model sampled (content, then its tool calls as hermes blocks,
then ``<|im_end|>``), so a call's prompt extends the previous call's prompt + reply where the reply's tool-call
JSON is written the way the template writes it."""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 3 + 4? Use the add tool, then answer with the number.",
    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
    "The answer is 7. 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": '
    '["a", "b"]}}}',
    "system user assistant tool Tools: Call a tool as error",
]


def save_tokenizer(path: Path) -> int:
    """The byte-level BPE tokenizer with the chat template; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(["<tool_call>", "</tool_call>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


def make_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(path)
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=vocab_size, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=2, initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the checkpoint into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialization")
    args = parser.parse_args()
    print(f"tiny Qwen3 with a tool-rendering chat template written to {make_model(Path(args.out_dir), args.seed)}")
