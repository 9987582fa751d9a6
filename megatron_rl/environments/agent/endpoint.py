"""The OpenAI-compatible endpoint an agent's episode talks to, and the record of its calls.

Place in the data flow (global rank 0 only, inside ``AgentEnvironment.rollout``)::

    agent thread ── POST http://127.0.0.1:PORT/<episode token>/v1/chat/completions ──> AgentEndpoint
      -> Session.chat: messages (+ tools) -> Conversation (render with the chat template: extend or new step)
         -> complete(prompt ids, spec, seed, session) on the fleet -> add_response (sampled ids, log-probs)
         -> parse the text (rollout.tool_call_parser) -> a ChatCompletion JSON back to the agent

One server per job (``ThreadingHTTPServer`` on loopback, a free port); each episode gets its own URL with an
unguessable token (``secrets.token_urlsafe``), removed when the episode ends: a request with any other token is
answered 401, so no other process can add calls to a training episode. Routes: ``POST /<token>/v1/chat/
completions`` (non-streaming; ``stream: true`` is a 400) and ``GET /<token>/v1/models``; any ``model`` name is
accepted.

What the job decides, not the agent: the sampling temperature and top-p are the job's (``job.temperature``;
evaluation: ``eval.temperature``), because the trainer's log-probs must be those of the distribution sampled
from (an agent that asks for others is told once, on stderr: ``note_sampling_request``); the agent's
``max_tokens`` is honoured up to ``job.max_new_tokens``. A call whose rendered prompt is longer
than the prompt limit is a 400 ``context_length_exceeded``, and so is every later call of that episode (it keeps
the calls before it). A call the fleet cannot serve is a 503 and stops the step with an ``EngineError``
(``Session.engine_error``).

Images (a vision-language checkpoint, ``Session.images``; docs/VISION.md section 14): a message's content parts
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (a tool result's screenshot) become
the checkpoint's image placeholder in its text, and the images go, in order, through the checkpoint's processor
with the conversation (``turn_images.py``); each call is sampled with every image of its prompt (the fleet's
``complete(images=EngineImages)``). An image that cannot be read is a 400 naming it, and so are image parts sent to
a text checkpoint.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_rl.environments.agent.tool_parsers import ParsedReply, ToolCallParser
from megatron_rl.data.images import ImageError
from megatron_rl.environments.conversation import Conversation, Message
from megatron_rl.environments.turn_images import NO_IMAGES, TurnImages
from megatron_rl.inference.engine import Completion, SamplingSpec

Complete = Callable[..., Completion]
"""``complete(prompt_ids, spec, *, seed, session) -> Completion``: ``Fleet.complete`` (``inference/vllm/calls.py``)."""


class RequestError(Exception):
    """A call the endpoint refuses: HTTP ``status``, an OpenAI error ``code``, a one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Session:
    """One episode's calls: renders, samples, records (``conversation.turns``). Thread-safe: the calls of one
    episode run one at a time, in the order they arrive."""

    def __init__(self, name: str, tokenizer: Any, complete: Complete, spec: SamplingSpec, *,
                 seed_of_call: Callable[[int], int], max_prompt_tokens: int, parse: ToolCallParser,
                 tokenizer_lock: threading.Lock, images: TurnImages | None = None) -> None:
        """``images``: the checkpoint's image encoder (None: image parts are refused)."""
        self.name, self.tokenizer, self.complete, self.spec = name, tokenizer, complete, spec
        self.images = images
        self.seed_of_call, self.max_prompt_tokens, self.parse = seed_of_call, max_prompt_tokens, parse
        self.tokenizer_lock = tokenizer_lock
        self.conversation: Conversation | None = None
        self.calls = 0
        self.context_error: str | None = None
        """Set when a call's prompt was too long: this and every later call are refused."""
        self.engine_error: str | None = None
        self._lock = threading.Lock()

    @property
    def turns(self) -> list:
        return self.conversation.turns if self.conversation is not None else []

    def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        """A ChatCompletion for ``request`` (the JSON body); RequestError for a call that is refused."""
        messages, tools, max_tokens, images = _checked_request(
            request, self.spec.max_tokens, self.images.placeholder if self.images is not None else None)
        note_sampling_request(request, self.spec)
        with self._lock:
            if self.engine_error:  # the step stops after its episodes: no more calls
                raise RequestError(503, f"the rollout engine could not serve an earlier call: {self.engine_error}",
                                   "engine_error")
            prompt_ids = self._render(messages, tools, images)
            spec = SamplingSpec(max_tokens=max_tokens, temperature=self.spec.temperature, top_p=self.spec.top_p,
                                stop_token_ids=self.spec.stop_token_ids)
            seed, self.calls = self.seed_of_call(self.calls), self.calls + 1
            try:
                completion = self.complete(prompt_ids, spec, seed=seed, session=self.name, **self._engine_images())
            except Exception as err:  # the fleet's EngineError (or a bug): the step stops after the episodes
                self.engine_error = self.engine_error or f"{type(err).__name__}: {err}"
                raise RequestError(503, f"the rollout engine could not serve this call: {err}", "engine_error")
            assert self.conversation is not None
            with self.tokenizer_lock:
                self.conversation.add_response(completion.token_ids, completion.logprobs, completion.finish_reason,
                                               completion.extra)
                text = self._reply_text(completion.token_ids)
        parsed = self.parse(text) if request.get("tool_choice") != "none" else ParsedReply(text)
        return _chat_completion(request, prompt_ids, completion, parsed)

    def _engine_images(self) -> dict[str, Any]:
        """``complete``'s ``images`` keyword for a prompt with images (none for a text prompt)."""
        assert self.conversation is not None
        if not self.conversation.images:
            return {}
        from megatron_rl.inference.vllm.images import EngineImages

        assert self.images is not None
        return {"images": EngineImages(tuple(self.conversation.images.urls), self.images.image_token_id)}

    def _render(self, messages: list[Message], tools: list[dict] | None, images: list[Any]) -> list[int]:
        if self.context_error:
            raise RequestError(400, self.context_error, "context_length_exceeded")
        with self.tokenizer_lock:
            try:
                if self.conversation is None:
                    self.conversation = Conversation(self.tokenizer, messages, tools, images=self.images,
                                                     first_images=images)
                else:
                    self.conversation.continue_with(messages, tools, images)
            except ImageError as err:
                raise RequestError(400, f"an image of these messages cannot be used: {err}") from None
            except Exception as err:  # noqa: BLE001 - the template's (jinja) errors on these messages
                raise RequestError(400, f"the chat template could not render these messages: "
                                        f"{type(err).__name__}: {err}") from None
            prompt_ids = self.conversation.prompt_ids
        if len(prompt_ids) > self.max_prompt_tokens:
            self.context_error = (f"the prompt has {len(prompt_ids)} tokens, more than the {self.max_prompt_tokens} "
                                  "this job allows (data.max_prompt_tokens, else the model's context minus "
                                  "job.max_new_tokens); this episode takes no more calls")
            raise RequestError(400, self.context_error, "context_length_exceeded")
        return prompt_ids

    def _reply_text(self, token_ids: list[int]) -> str:
        """The reply's text for the parser: special tokens kept (a template's tool-call tags may be special), the
        stop token that ended it dropped."""
        ids = list(token_ids)
        if ids and ids[-1] in self.spec.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


_sampling_noted = threading.Event()


def note_sampling_request(request: dict[str, Any], spec: SamplingSpec) -> str | None:
    """An agent that asks for another ``temperature`` or ``top_p`` than the job samples with is told so, once per
    process, on stderr (the call is served with the job's); returns the line when it is printed."""
    asked = {key: request.get(key) for key in ("temperature", "top_p") if request.get(key) is not None}
    try:
        differs = {key: value for key, value in asked.items() if float(value) != float(getattr(spec, key))}
    except (TypeError, ValueError):
        differs = asked
    if not differs or _sampling_noted.is_set():
        return None
    _sampling_noted.set()
    line = (f"megatron_rl: job.agent asked for {', '.join(f'{k}={v}' for k, v in differs.items())}; every call is "
            f"sampled with the job's temperature={spec.temperature:g}, top_p={spec.top_p:g} (job.temperature, "
            "job.top_p; evaluation: eval.temperature), since the trainer scores the tokens under the distribution "
            "they were sampled from (this message is shown once)")
    print(line, file=sys.stderr, flush=True)
    return line


def _checked_request(request: Any, max_new_tokens: int, placeholder: str | None = None
                     ) -> tuple[list[Message], list[dict] | None, int, list[Any]]:
    """The messages (normalized for the chat template), the tools, the reply's token cap of a request body and the
    images of its ``image_url`` parts, in order (each part's place in its text: ``placeholder``, the checkpoint's
    image placeholder; None: image parts are refused)."""
    if not isinstance(request, dict):
        raise RequestError(400, "the body must be a JSON object")
    if request.get("stream"):
        raise RequestError(400, "stream: true is not supported: this endpoint answers whole completions; call it "
                                "without stream (the openai client: stream=False, the default)")
    if request.get("n", 1) != 1:
        raise RequestError(400, f"n={request.get('n')}: one choice per call (make n calls instead)")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(400, "tools must be a list of tool schemas")
    cap = request.get("max_completion_tokens") or request.get("max_tokens") or max_new_tokens
    if not isinstance(cap, int) or cap < 1:
        raise RequestError(400, f"max_tokens={cap!r} must be a positive integer")
    images: list[Any] = []
    return ([_template_message(m, placeholder, images) for m in messages], tools or None, min(cap, max_new_tokens),
            images)


def _template_message(message: dict[str, Any], placeholder: str | None = None, images: list[Any] | None = None
                      ) -> Message:
    """An OpenAI message as chat templates expect it: content a string ('' when absent or null; text parts
    joined, an ``image_url`` part as ``placeholder`` with its URL appended to ``images``), tool-call arguments
    parsed from their JSON string into a dict (as vLLM does before rendering)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        content = "".join(_part_text(part, placeholder, images) for part in content if isinstance(part, dict))
    out["content"] = content if isinstance(content, str) else ""
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def _part_text(part: dict[str, Any], placeholder: str | None, images: list[Any] | None) -> str:
    """A content part's text: a text part's text, an image part's ``placeholder`` (its URL kept in ``images``)."""
    if part.get("type") not in ("image_url", "image"):
        return part.get("text", "")
    if placeholder is None or images is None:
        raise RequestError(400, f"an {part.get('type')!r} content part, but {NO_IMAGES}")
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise RequestError(400, f"an {part.get('type')!r} content part without a URL: {str(part)[:80]!r}")
    images.append(url)
    return placeholder


def _chat_completion(request: dict[str, Any], prompt_ids: list[int], completion: Completion,
                     parsed: ParsedReply) -> dict[str, Any]:
    """The OpenAI ChatCompletion JSON (plus vLLM's extras: ``prompt_token_ids``, ``choices[0].token_ids``)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls]
    reason = completion.finish_reason
    if parsed.tool_calls and reason == "stop":
        reason = "tool_calls"
    sampled = len(completion.token_ids)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
        "model": request.get("model") or "megatron_rl",
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None,
                     "token_ids": list(completion.token_ids)}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": sampled,
                  "total_tokens": len(prompt_ids) + sampled},
        "prompt_token_ids": list(prompt_ids),
    }  # fmt: skip


class AgentEndpoint:
    """The loopback HTTP server every episode's URL points at; ``open(session)`` -> the episode's ``/v1`` URL."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        endpoint = self

        class Handler(_Handler):
            owner = endpoint

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.host, self.port = host, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()

    def open(self, session: Session) -> str:
        token = secrets.token_urlsafe(24)
        with self._lock:
            self.sessions[token] = session
        return f"http://{self.host}:{self.port}/{token}/v1"

    def close_session(self, base_url: str) -> None:
        token = base_url.rstrip("/").split("/")[-2]
        with self._lock:
            self.sessions.pop(token, None)

    def session(self, token: str) -> Session | None:
        with self._lock:
            return self.sessions.get(token)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: AgentEndpoint
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client (httpx) reuses its connection

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        token, route = self._route()
        if self.owner.session(token) is None:
            return self._unknown_token()
        if route == "/v1/models":
            return self._send(200, {"object": "list", "data": [
                {"id": "megatron_rl", "object": "model", "created": 0, "owned_by": "megatron_rl"}]})
        self._send(404, _error(f"no route GET {route}", "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        token, route = self._route()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        session = self.owner.session(token)
        if session is None:
            return self._unknown_token()
        if route != "/v1/chat/completions":
            return self._send(404, _error(f"no route POST {route} (this endpoint serves /v1/chat/completions)",
                                          "not_found"))
        try:
            request = json.loads(body or b"null")
        except json.JSONDecodeError as err:
            return self._send(400, _error(f"the body is not JSON: {err}", "invalid_request_error"))
        try:
            self._send(200, session.chat(request))
        except RequestError as err:
            self._send(err.status, _error(str(err), err.code))
        except Exception as err:  # noqa: BLE001 - a bug of ours: the agent gets a 500 instead of a dropped connection
            self._send(500, _error(f"{type(err).__name__}: {err}", "internal_error"))
            raise

    def _route(self) -> tuple[str, str]:
        """``/<token>/v1/...`` -> (token, ``/v1/...``)."""
        path = self.path.split("?", 1)[0]
        token, _, rest = path.lstrip("/").partition("/")
        return token, "/" + rest

    def _unknown_token(self) -> None:
        self._send(401, _error("unknown episode token: this endpoint serves only the URLs the job hands to its "
                               "agent's episodes (base_url)", "invalid_api_key"))

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one line per call is noise
        pass


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
