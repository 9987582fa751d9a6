"""Tool-call parsers (``rollout.tool_call_parser``): the text of a sampled reply -> its content and tool calls.

Place in the data flow: the agent endpoint (``endpoint.py``) answers each call with ``parse(text)`` as an OpenAI
message. The fleet runs token-in/token-out (``--skip-tokenizer-init``), so vLLM's own parsers never see the
text: parsing is the job's, after sampling; the trained tokens are the sampled ids whatever the parse finds.

A parser is a pure function ``text -> ParsedReply``; ``register_tool_call_parser`` adds one (a name taken is a
ValueError). Built in:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3); the
  content is the text before the first block (None when blank). As vLLM's hermes parser: a block that is not
  valid JSON with a ``name`` leaves the whole text as content and no tool calls; an unterminated last block (a
  reply cut by ``max_tokens``) is parsed if its JSON is complete.
- ``none``: no tool calls; the whole text is the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string (the OpenAI wire format)."""


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


ToolCallParser = Callable[[str], ParsedReply]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_tool_call_parser(name: str, parser: ToolCallParser) -> None:
    """Make ``rollout.tool_call_parser=<name>`` use ``parser``; ValueError for a name taken."""
    if name in TOOL_CALL_PARSERS:
        raise ValueError(f"tool-call parser {name!r} is already registered; pick another name "
                         f"(registered: {sorted(TOOL_CALL_PARSERS)})")
    TOOL_CALL_PARSERS[name] = parser


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser ``name``; ValueError listing the registered ones otherwise."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"rollout.tool_call_parser={name!r} is not one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedReply(text)
    calls = []
    for match in _HERMES_BLOCK.finditer(text, start):
        call = _hermes_call(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    content = text[:start]
    return ParsedReply(content if content.strip() else None, calls)


def _hermes_call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


register_tool_call_parser("hermes", parse_hermes)
register_tool_call_parser("none", ParsedReply)
