"""The HTTP layer's answers to bad requests, through a real aiohttp server and raw
bytes on the wire, with a stand-in for the token host (no fabric): every
refusal is a 400 (or 404) carrying the OpenAI error object, never a 500."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from fabric.serving import api
from fabric.serving.http import make_app

aiohttp = pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

MODEL = "semfab-toy"


class StubHost:
    """What the request handlers read of a TokenHost before opening a stream; a
    request that passes every check reaches ``open``, which answers 503."""

    def __init__(self) -> None:
        self.models = (MODEL,)
        self.cfg = SimpleNamespace(max_tokens_limit=4096)
        self.opened: list[api.GenRequest] = []

    def open(self, req: api.GenRequest) -> Any:
        self.opened.append(req)
        raise api.ApiError(503, "stub host: no chain behind this server",
                           type_="server_error")


def _post_all(bodies: list[tuple[str, bytes]]) -> tuple[list[tuple[int, Any, str]], StubHost]:
    host = StubHost()

    async def go() -> list[tuple[int, Any, str]]:
        async with TestClient(TestServer(make_app(host))) as client:  # type: ignore[arg-type]
            out = []
            for path, raw in bodies:
                resp = await client.post(path, data=raw,
                                         headers={"Content-Type": "application/json"})
                text = await resp.text()
                out.append((resp.status, json.loads(text), resp.headers["Content-Type"]))
            return out

    return asyncio.run(go()), host


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", **fields}).encode()


DEEP = b'{"model": "semfab-toy", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"

BAD = [
    # (path, raw body, status, param)
    ("/v1/completions", b'{"model": "semfab-toy", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "semfab-toy", "prompt": ["\\udfff"]}', 400, "prompt"),
    ("/v1/chat/completions",
     b'{"model": "semfab-toy", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     400, "messages[0].content"),
    ("/v1/chat/completions",
     b'{"model": "semfab-toy", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\ud83d"}]}]}', 400, "messages[0].content"),
    # a lone surrogate quoted back in the error message: still valid JSON
    ("/v1/completions", b'{"model": "m\\ud800", "prompt": "x"}', 404, "model"),
    ("/v1/completions", DEEP, 400, None),
    ("/v1/chat/completions", b"[" * 100_000, 400, None),
    ("/v1/completions", _body(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage"),
    ("/v1/completions", _body(stream=True, stream_options={"include_usage": 1}), 400,
     "stream_options.include_usage"),
    ("/v1/completions", _body(top_p=-0.1), 400, "top_p"),
    ("/v1/completions", _body(top_p=1.5), 400, "top_p"),
    ("/v1/completions", _body(top_p="1"), 400, "top_p"),
    ("/v1/completions", b'{"model": "semfab-toy", "prompt": "x", "top_p": NaN}', 400, "top_p"),
    ("/v1/completions", b'{"model": "semfab-toy", "prompt": "x", "temperature": Infinity}',
     400, "temperature"),
    ("/v1/completions", _body(min_p=2), 400, "min_p"),
    ("/v1/completions", _body(presence_penalty=-3), 400, "presence_penalty"),
    ("/v1/completions", _body(frequency_penalty=2.5), 400, "frequency_penalty"),
    ("/v1/completions", _body(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", _body(top_k=0), 400, "top_k"),
    ("/v1/completions", _body(top_k=-2), 400, "top_k"),
    ("/v1/completions", _body(top_k=1.5), 400, "top_k"),
    ("/v1/completions", _body(user=5), 400, "user"),
    ("/v1/completions", _body(detokenize="no"), 400, "detokenize"),
]


def test_bad_requests_are_400_with_the_openai_error_object() -> None:
    results, host = _post_all([(path, raw) for path, raw, _, _ in BAD])
    for (_path, raw, status, param), (got, body, ctype) in zip(BAD, results, strict=True):
        what = raw[:80]
        assert got == status, (what, got, body)
        assert ctype.startswith("application/json"), what
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what
        assert err["type"] == "invalid_request_error", (what, err)
        assert err["param"] == param, (what, err)
    assert host.opened == []  # not one reached the chain


def test_in_range_sampling_parameters_pass_the_checks() -> None:
    """Values an OpenAI client may send are accepted (the toy model ignores them)."""
    good = [_body(top_p=0), _body(top_p=1), _body(top_p=0.9, min_p=0.05, top_k=-1),
            _body(top_k=40, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.1),
            _body(stream=True, stream_options={"include_usage": False}, user="me"),
            b'{"model": "semfab-toy", "prompt": "caf\\u00e9 \\ud83d\\ude00"}']
    results, host = _post_all([("/v1/completions", raw) for raw in good])
    assert [status for status, _, _ in results] == [503] * len(good)
    assert len(host.opened) == len(good)
    assert host.opened[-1].prompt == "caf\u00e9 \U0001f600"  # a surrogate pair is one character
    assert host.opened[4].include_usage is False and host.opened[4].stream is True
