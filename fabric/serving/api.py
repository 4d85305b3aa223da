"""The OpenAI-compatible layer, sans-IO: request checks, response objects, SSE.

Nothing here touches a socket: the HTTP driver (:mod:`fabric.serving.host`)
hands in parsed JSON and writes out the bytes these functions return, and the
client (:mod:`fabric.serving.client`) feeds received bytes to
:class:`SSEDecoder`.

Errors follow the OpenAI shape, ``{"error": {"message", "type", "param",
"code"}}``, with the status an OpenAI client expects: 400 for a bad request,
404 for an unknown model or route, 429 when the server's queue is full, 503
while it shuts down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The one SSE event that ends a stream.
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}
#: Parameters whose non-default values the toy model cannot honour.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "logit_bias": (None, {}),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the server refuses; ``body()`` is the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class GenRequest:
    """A validated generation request."""

    kind: str  # "completion" or "chat"
    prompt: str | None  # prompt text (None when given as token ids)
    prompt_ids: list[int] | None
    max_tokens: int
    temperature: float | None
    stream: bool
    include_usage: bool
    model: str
    detokenize: bool | None  # None: the server's setting
    seed: int | None = None  # sampling seed: the same seed gives the same text


def parse_json(raw: bytes) -> Any:
    """Decode a request body; ApiError 400 when it is not JSON (or nested deeper
    than the parser can follow)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "We could not parse the JSON body of your request: it is "
                       "nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}") from None


def _text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"'{param}' is not valid Unicode text: it holds a lone surrogate "
                       f"({value[exc.start]!r} at position {exc.start})", param) from None
    return value


def _shown(value: Any) -> str:
    """A short repr of a client's value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_shown(value)}", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {_shown(value)}", name)
    return value


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    """An optional finite number in [lo, hi] (JSON's NaN and Infinity are not)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {_shown(value)}", name)
    if not lo <= value <= hi:  # also false for NaN
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _bool(obj: dict[str, Any], name: str, param: str) -> bool | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{param}' must be a boolean, got {_shown(value)}", param)
    return value


#: Sampling parameters the toy model accepts (and ignores) when in their range:
#: OpenAI's, and the common extensions of OpenAI-compatible servers.
_SAMPLING_RANGES = {
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (1e-6, 1e6),
}


def _common(body: Any, models: tuple[str, ...], limit: int) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise ApiError(400, "you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    if model not in models:
        raise ApiError(404, f"The model `{model}` does not exist", "model", "model_not_found")
    stream = _bool(body, "stream", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           "stream_options")
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        include_usage = bool(_bool(opts, "include_usage", "stream_options.include_usage"))
    temperature = _number(body, "temperature", 0.0, 2.0)
    for name, (lo, hi) in _SAMPLING_RANGES.items():
        _number(body, name, lo, hi)
    top_k = _int(body, "top_k", -1, -1, 1 << 30)
    if top_k == 0:  # -1 is "no limit"; 0 would leave no token to sample
        raise ApiError(400, "'top_k' must be -1 (no limit) or at least 1, got 0", "top_k")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string, got {_shown(user)}", "user")
    if _int(body, "n", 1, 1, 1 << 30) != 1:
        raise ApiError(400, "Only n=1 is supported", "n")
    for name, defaults in _UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise ApiError(400, f"'{name}' is not supported by this server", name)
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise ApiError(400, "'stop' sequences are not supported by this server", "stop")
    detokenize = _bool(body, "detokenize", "detokenize")
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(400, f"'seed' must be an integer, got {_shown(seed)}", "seed")
        if not -(1 << 63) <= seed < 1 << 64:
            raise ApiError(400, "'seed' must fit in 64 bits", "seed")
    _bool(body, "ignore_eos", "ignore_eos")
    return {"model": model, "stream": bool(stream), "include_usage": include_usage,
            "temperature": temperature, "detokenize": detokenize, "limit": limit, "seed": seed}


def parse_completion(body: Any, models: tuple[str, ...], limit: int,
                     default_max_tokens: int = 16) -> GenRequest:
    """Validate a ``POST /v1/completions`` body."""
    c = _common(body, models, limit)
    prompt = body.get("prompt")
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        text = _text(prompt, "prompt")
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        ids = list(prompt)
    elif prompt is None:
        raise ApiError(400, "you must provide a prompt", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise ApiError(400, "Only one prompt per request is supported", "prompt")
    else:
        raise ApiError(400, "'prompt' must be a string, a list of one string, "
                       "or a list of token ids", "prompt")
    max_tokens = _int(body, "max_tokens", default_max_tokens, 1, limit)
    return GenRequest("completion", text, ids, max_tokens, c["temperature"], c["stream"],
                      c["include_usage"], c["model"], c["detokenize"], c["seed"])


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return _text(content, f"messages[{i}].content")
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            parts.append(_text(part["text"], f"messages[{i}].content"))
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   f"messages[{i}].content")


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The toy model's chat template: one ``<|role|>`` line per message, then the reply."""
    lines = [f"<|{m['role']}|>\n{_content_text(m.get('content'), i)}"
             for i, m in enumerate(messages)]
    return "\n".join(lines) + "\n<|assistant|>\n"


def parse_chat(body: Any, models: tuple[str, ...], limit: int,
               default_max_tokens: int = 256) -> GenRequest:
    """Validate a ``POST /v1/chat/completions`` body."""
    c = _common(body, models, limit)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in "
                           f"{', '.join(_ROLES)}", f"messages[{i}].role")
        _content_text(m.get("content"), i)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, name, min(default_max_tokens, limit), 1, limit)
    return GenRequest("chat", chat_prompt(messages), None, max_tokens, c["temperature"],
                      c["stream"], c["include_usage"], c["model"], c["detokenize"], c["seed"])


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# The JSON string encoder json.dumps itself uses (the C one when available):
# one call per event instead of a whole dumps, non-ASCII kept as UTF-8.
_json_str = json.encoder.encode_basestring


class ChunkFormatter:
    """SSE events of one streamed response, with the constant JSON parts pre-encoded.

    Only the text (or token ids) is encoded per event; the rest of the chunk
    object is fixed for the response, so it is serialised once.
    """

    def __init__(self, kind: str, response_id: str, model: str, created: int) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = created
        head = {"id": response_id, "object": "chat.completion.chunk" if kind == "chat"
                else "text_completion", "created": self.created, "model": model}
        self._head = "data: " + _dumps(head)[:-1] + ',"choices":[{"index":0,'
        self.events = 0  # data events produced (the client counts the same)

    def role(self) -> bytes:
        """Chat only: the first event, announcing the assistant's role."""
        self.events += 1
        return (self._head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
                '"finish_reason":null}]}\n\n').encode()

    def delta(self, text: str, token_ids: list[int] | None = None,
              finish_reason: str | None = None) -> bytes:
        """One event carrying ``text`` (and token ids when the client detokenizes)."""
        self.events += 1
        ids = "" if token_ids is None else ',"token_ids":[' + ",".join(map(str, token_ids)) + "]"
        fin = "null" if finish_reason is None else _json_str(finish_reason)
        if self.kind == "chat":
            body = '"delta":{"content":' + _json_str(text) + ids + "}"
        else:
            body = '"text":' + _json_str(text) + ids
        return (self._head + body + ',"logprobs":null,"finish_reason":' + fin
                + "}]}\n\n").encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The final usage event (``stream_options.include_usage``)."""
        self.events += 1
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        obj: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                               "model": self.model, "choices": [],
                               "usage": usage(prompt_tokens, completion_tokens)}
        return ("data: " + _dumps(obj) + "\n\n").encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(response_id: str, model: str, created: int, text: str,
                        finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        kind: str, token_ids: list[int] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if token_ids is not None:
            message["token_ids"] = token_ids
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def models_list(models: tuple[str, ...], created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "semfab"} for m in models]}


def error_event(err: ApiError) -> bytes:
    """An error reported inside an already started stream."""
    return ("data: " + _dumps(err.body()) + "\n\n").encode()


class SSEDecoder:
    """Split a server-sent event stream into ``data`` payloads (client side).

    Handles events cut anywhere across reads, CRLF line ends, comments and
    multi-line data. ``feed`` returns the payloads of the events it completed.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Payloads of the events completed by ``chunk``."""
        self._buf += chunk
        out: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8")
            self._buf = self._buf[nl + 1:]
            if not line:  # blank line: the event is complete
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # comments (":...") and other fields (event:, id:, retry:) are ignored
