"""Conversation tokens: the token-exact record of one multi-turn conversation, turned into step-wise rows.

Place in the data flow: inside a multi-turn rollout, between the engine and the ``GeneratorOutput``. One builder
for every multi-turn source: step-API environments (``step_api/``) now, agents whose calls an OpenAI-compatible
endpoint records later (each call: the agent's messages -> ``continue_with`` -> prompt ids -> engine ->
``add_response``)::

    first messages -> prompt ids -> engine.generate -> add_response(sampled ids, log-probs) -> response text
      -> observation -> add_observation (extend, or a new step) -> prompt ids -> ... -> trajectory_rows

The trained tokens are the engine's sampled tokens, never re-tokenized text. Each turn's prompt is either

    extend:    previous prompt ids + sampled ids + ids of the rest of the rendering (observation, ...)
    new step:  ids of the fresh rendering of the whole conversation

With a chat template, the conversation (a list of ``{"role", "content"}`` messages, the assistant's replies as
their decoded text) is rendered with ``apply_chat_template`` (generation prompt added), and the rendering is
used only where it extends the text the model saw: the previous prompt's text followed by the sampled tokens'
text (special tokens included, e.g. the eos that ended the reply). The rest of the rendering (whatever closes
the assistant's turn that the sampler did not produce, the observation, the generation prompt) is tokenized on
its own and appended. Where it does not extend (a template that rewrites history, e.g. Qwen3's removal of
``<think>`` blocks from earlier assistant turns, or one that reformats the reply), the turn starts a new step
whose prompt is the fresh rendering. Without a chat template, text is raw: the first prompt is tokenized as is
(special tokens added) and each observation's text is tokenized and appended: always an extension.

Images (a vision-language checkpoint; ``turn_images.py``): the first prompt and each observation may come with
images, one placeholder per image in their text; each is expanded to its image tokens when that text is
tokenized, and every turn keeps the images of its whole prompt (``Turn.images``: earlier turns' first), so its
row carries every image its tokens show. An extension also needs the earlier images unchanged (an agent that
resends its history with another picture starts a new step).

Rows (``trajectory_rows``): one per turn in the step-wise layout of ``data/generator_output.py`` (the turn's
prompt, its sampled ids with loss mask 1 and the sampler's log-probs; the trajectory's reward on its last
turn). ``data/merge.py`` merges the turns whose prompts extend the previous prompt + response into one
sequence, the observation tokens between them masked out, so a template that keeps history gives one sequence
per conversation and one that rewrites it gives one per new step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.data.images import ImageError
from megatron_rl.environments.base import Sample
from megatron_rl.environments.turn_images import NO_IMAGES, RowImages, TurnImages, joined

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (other keys, e.g. ``tool_calls``, go to the template)."""


@dataclass
class Turn:
    """One sampled reply and the prompt it answered."""

    prompt_ids: list[int]
    response_ids: list[int]
    """The engine's sampled ids (trained as they are)."""
    logprobs: list[float]
    finish_reason: str
    extends: bool
    """The prompt is the previous turn's prompt + response + more (False on the first turn and on a new step)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The engine's extras for this call (``Completion.extra``, e.g. ``routed_experts``)."""
    images: Any = None
    """The images of ``prompt_ids``, in order (``turn_images.py``: a ``RowImages``, what the engine saw); None
    without an image encoder."""


def weight_versions(episodes: Sequence[Sequence[Turn]]) -> tuple[dict[str, float], dict[int, int]]:
    """With partial rollouts the engine labels each sampled token with the weight version (syncs before it) that
    generated it (``Completion.extra["weight_versions"]``), so an episode's turns, and even one reply, may span a
    sync. Returns ``episode/mixed_versions`` (the fraction of ``episodes``, each its turns, whose tokens come from
    more than one version) and the tokens per version; ({}, {}) when no turn is labelled."""
    tokens: dict[int, int] = {}
    mixed = labelled = 0
    for turns in episodes:
        versions = [v for t in turns for v in t.extra.get("weight_versions", ())]
        if not versions:
            continue
        labelled += 1
        mixed += len(set(versions)) > 1
        for v in versions:
            tokens[v] = tokens.get(v, 0) + 1
    return ({"episode/mixed_versions": mixed / labelled} if labelled else {}), tokens


def readable_turns(turns: Sequence[Turn], tokenizer: Any, *,
                   tool_calls: Callable[[list[int]], list[dict]] | None = None) -> list[dict[str, Any]]:
    """An episode's turns for people to read (``samples.jsonl``): per turn the prompt text new to it (the whole
    first prompt; after it, what follows the previous reply: the observation or tool result and the template's
    markers, or the whole fresh rendering of a new step, ``"new_step": true``), the reply, and with
    ``tool_calls`` (an agent's parser, on the reply's ids) its parsed tool calls. Decoded with the special
    tokens kept, so the chat template's markers stay visible."""
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    readable: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        seen = len(turns[i - 1].prompt_ids) + len(turns[i - 1].response_ids) if i and turn.extends else 0
        record: dict[str, Any] = {"prompt": decode(turn.prompt_ids[seen:]), "response": decode(turn.response_ids)}
        if i and not turn.extends:
            record["new_step"] = True
        if tool_calls is not None:
            record["tool_calls"] = tool_calls(turn.response_ids)
        readable.append(record)
    return readable


def episode_sample(turns: Sequence[Turn], tokenizer: Any, *, reward: float | None, row: int | None,
                   error: str | None, end: str | None, first_prompt_ids: Sequence[int] = (),
                   tool_calls: Callable[[list[int]], list[dict]] | None = None) -> Sample:
    """A multi-turn episode as one ``Sample``: every turn (``readable_turns``), the reward, why it ended;
    ``prompt`` the first prompt (``first_prompt_ids`` when it played no turn), ``response`` the last reply."""
    readable = readable_turns(turns, tokenizer, tool_calls=tool_calls)
    prompt = readable[0]["prompt"] if readable else tokenizer.decode(list(first_prompt_ids), skip_special_tokens=False)
    return Sample(prompt, readable[-1]["response"] if readable else "", reward, row=row, error=error,
                  turns=readable, end=end)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class Conversation:
    """The token-exact record of one conversation (see the module docstring). ``prompt_ids`` is the prompt of
    the turn to sample next; ``turns`` the turns sampled so far."""

    def __init__(self, tokenizer: Any, first: str | list[Message], tools: list[dict] | None = None, *,
                 images: TurnImages | None = None, first_images: Sequence[Any] = ()) -> None:
        """``first``: the opening messages, or a string (a user message with a chat template, raw text
        without); ValueError for messages and a tokenizer without a chat template. ``tools``: the tool schemas
        the template renders (an agent's call; None = none). ``images``: the image encoder (a vision-language
        checkpoint; None: text only, and images are a ValueError); ``first_images``: the images of ``first``'s
        placeholders, in order (``ImageError`` when one cannot be read or the count does not match)."""
        self.tokenizer = tokenizer
        self.tools = tools
        self.chat = has_chat_template(tokenizer)
        self.turns: list[Turn] = []
        self.messages: list[Message] = []
        self.text = ""
        """The text of ``prompt_ids`` (chat: the rendering the model saw)."""
        self._extends = False
        self.encoder = images
        self.image_refs: list[Any] = []
        """The references of the images of ``prompt_ids``, in order."""
        self.images: RowImages | None = None
        """Their patches and URLs (``turn_images.py``), what the engine takes with ``prompt_ids``; None without an
        encoder."""
        if self.chat:
            self.messages = as_messages(first)
            self.text = self._render(self.messages)
            self.prompt_ids, self.images = self._encode(self.text, first_images)
        else:
            self.prompt_ids, self.images = self._encode(_raw_text(first), first_images, add_special_tokens=True)
        self.image_refs = list(first_images)

    def add_response(self, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str,
                     extra: dict[str, Any] | None = None) -> str:
        """Record the engine's reply to ``prompt_ids``; returns its text (special tokens skipped)."""
        assert len(self.turns) == 0 or self.turns[-1].prompt_ids is not self.prompt_ids, "one reply per prompt"
        self.turns.append(Turn(self.prompt_ids, list(token_ids), list(logprobs), finish_reason, self._extends,
                               dict(extra or {}), self.images))
        text = self._decode(token_ids, skip_special_tokens=True)
        if self.chat:
            self.messages.append({"role": "assistant", "content": text})
        return text

    def add_observation(self, observation: str | list[Message], images: Sequence[Any] = ()) -> None:
        """Append the environment's answer to the last reply and make the next prompt (extend or new step);
        ``images``: those of the observation's placeholders, in order."""
        assert self.turns, "an observation answers a reply: add_response first"
        if self.chat:
            self.continue_with(self.messages + as_messages(observation), self.tools, [*self.image_refs, *images])
            return
        ids, new = self._encode(_raw_text(observation), images)
        self.prompt_ids = self._seen_ids() + ids
        self.images = joined(self.images, new) if self.images is not None else None
        self.image_refs += list(images)
        self._extends = True
        self._check_image_tokens()

    def continue_with(self, messages: list[Message], tools: list[dict] | None = None,
                      images: Sequence[Any] | None = None) -> None:
        """The next prompt for the whole conversation ``messages`` (the history so far, the last reply's text
        included, plus what follows it): extend or new step. An agent's call hands its own history here, and the
        call's ``tools``. ``images``: the images of the whole conversation's placeholders, in order (None: the
        ones so far); it extends only if they begin with the images so far."""
        assert self.chat and self.turns, "continue_with needs a chat template and a reply to continue from"
        refs = list(self.image_refs if images is None else images)
        known = len(self.image_refs)
        text = self._render(messages)
        seen = self.text + self._decode(self.turns[-1].response_ids, skip_special_tokens=False)
        extends = text.startswith(seen) and refs[:known] == self.image_refs
        if extends:
            ids, new = self._encode(text[len(seen):], refs[known:])
            prompt_ids, row_images = self._seen_ids() + ids, joined(self.images, new) if new is not None else None
        else:
            prompt_ids, row_images = self._encode(text, refs)
        self.tools, self._extends, self.prompt_ids, self.images = tools, extends, prompt_ids, row_images
        self.messages, self.text, self.image_refs = list(messages), text, refs
        self._check_image_tokens()

    def _check_image_tokens(self) -> None:
        """ImageError when the prompt holds more image tokens than its images take: a reply sampled the image
        token (a young model does), and the engines would read it as part of an image (the built-in engine gives
        each image the row's first image tokens; vLLM counts the image-token runs), so the turn could not be
        sampled and scored alike: the episode is left out."""
        if not self.images:
            return
        held = self.prompt_ids.count(self.encoder.image_token_id)
        taken = self.encoder.image_tokens(self.images)
        if held != taken:
            raise ImageError(f"the prompt holds {held} image tokens, its {len(self.images)} image(s) take {taken}: "
                             "a reply sampled the image token, which the engines would read as an image's")

    def _seen_ids(self) -> list[int]:
        last = self.turns[-1]
        return last.prompt_ids + last.response_ids

    def _render(self, messages: list[Message]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True,
                                                  tokenize=False)

    def _encode(self, text: str, images: Sequence[Any] = (), *, add_special_tokens: bool = False
                ) -> tuple[list[int], RowImages | None]:
        """The ids of ``text`` and the images of its placeholders (None without an encoder, which refuses images:
        ValueError)."""
        if self.encoder is None:
            if images:
                raise ValueError(f"{len(images)} image(s) given, but {NO_IMAGES}")
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), None
        return self.encoder.encode(self.tokenizer, text, images, add_special_tokens=add_special_tokens)

    def _decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    @property
    def new_steps(self) -> int:
        """Turns after the first whose prompt does not extend the previous turn's (the template rewrote history)."""
        return sum(not t.extends for t in self.turns[1:])


def as_messages(value: str | list[Message], roles: tuple[str, ...] | None = None) -> list[Message]:
    """A string as one user message, a message list as is; ValueError for anything else (or a role outside
    ``roles`` when given)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        raise ValueError(f"expected a string or a non-empty list of {{'role', 'content'}} messages, got "
                         f"{type(value).__name__}: {str(value)[:80]!r}")
    wrong = [m["role"] for m in value if roles is not None and m["role"] not in roles]
    if wrong:
        raise ValueError(f"messages with role(s) {wrong}: the roles allowed here are {list(roles or ())}")
    return [dict(m) for m in value]


def _raw_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"the tokenizer has no chat template, so prompts and observations must be strings (raw "
                         f"text), got {type(value).__name__}: {str(value)[:80]!r}; return strings, or use a "
                         "checkpoint whose tokenizer has a chat template")
    return value


def trajectory_rows(turns: list[Turn], *, reward: float, uid: Hashable, trajectory_id: Hashable) -> list[dict]:
    """The step-wise ``GeneratorOutput`` rows of one conversation: one per turn, ``reward`` on the last."""
    last = len(turns) - 1
    rows = [{"prompt_token_ids": t.prompt_ids, "response_ids": t.response_ids,
             "rewards": reward if i == last else 0.0, "loss_masks": [1] * len(t.response_ids), "uids": uid,
             "rollout_logprobs": t.logprobs, "trajectory_ids": trajectory_id, "is_last_step": i == last,
             "stop_reasons": t.finish_reason} for i, t in enumerate(turns)]
    if all("routed_experts" in t.extra for t in turns):  # MoE routing replay R3 (builtin_engine.py)
        for row, t in zip(rows, turns):
            row["routed_experts"] = t.extra["routed_experts"]
    if all(t.images is not None for t in turns):  # a vision-language model: every image of the turn's prompt
        for row, t in zip(rows, turns):
            row["images"] = t.images
    return rows
