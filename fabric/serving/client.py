"""A streaming OpenAI-API client that timestamps every server-sent event.

Used by ``semfab bench tokens`` and the tests. It is a plain aiohttp client
(no OpenAI SDK, which hides the event timing): it sends one request, reads
the response as it arrives, splits it into events with
:class:`~fabric.serving.api.SSEDecoder`, and records when each ``data`` event
was received (:func:`fabric.serving.clock.now_ns`, the clock the fabric's
processes use); the events are parsed after the stream ends unless something
needs them sooner. With ``detokenizer`` set it also plays the "detokenize
near the client" role: it turns the ``token_ids`` of each event into text
itself, as they come.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fabric.serving.api import SSEDecoder
from fabric.serving.clock import now_ns
from fabric.serving.detok import Detokenizer
from fabric.serving.metrics import ClientResult

__all__ = ["ClientResult", "now_ns", "stream_request"]



async def stream_request(session: Any, url: str, body: dict[str, Any], *,
                         detokenizer: Callable[[], Detokenizer] | None = None,
                         stop_after_events: int | None = None,
                         timeout_s: float = 120.0) -> ClientResult:
    """POST ``body`` (with ``"stream": true``) and read the whole event stream.

    ``stop_after_events``: close the connection after that many data events
    (a client that goes away mid-stream).
    """
    import aiohttp

    res = ClientResult()
    sse = SSEDecoder()
    detok = detokenizer() if detokenizer is not None else None
    chat = url.rstrip("/").endswith("/chat/completions")
    text: list[str] = []
    # Parse as the events come only when something needs them then (a client-side
    # detokenizer's timestamps, an early close); otherwise keep each read with its
    # time and parse after the stream. One client reads every stream, so a parse
    # done inline (JSON and SSE: about a third of its per-event time in a py-spy
    # profile) delays the reads of the other streams' events of the same step,
    # and that delay would be charged to them.
    inline = detok is not None or stop_after_events is not None
    reads: list[tuple[int, bytes]] = []
    res.t_send = now_ns()
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = await resp.text()
                res.t_end = now_ns()
                return res
            async for chunk in resp.content.iter_any():
                t = now_ns()
                if not inline:
                    reads.append((t, chunk))
                    continue
                _parse(res, sse, chunk, t, chat, detok, text)
                res.parse_ns += now_ns() - t
                if stop_after_events is not None and len(res.t_events) >= stop_after_events:
                    res.error = "closed by the client"
                    break
            else:  # the server closed the stream: some send no [DONE] after the last chunk
                _finish(res, sse, reads, chat, text)
                if res.error is None and res.finish_reason is not None:
                    res.ok = True
    except Exception as exc:  # reported per request; the benchmark counts failures
        error = f"{type(exc).__name__}: {exc}"
        try:
            _finish(res, sse, reads, chat, text)  # what came before it
        except Exception:
            pass  # a read cut short: the error above says why
        res.error = error
    res.t_end = now_ns()
    res.text = "".join(text)
    return res


def _finish(res: ClientResult, sse: SSEDecoder, reads: list[tuple[int, bytes]], chat: bool,
            text: list[str]) -> None:
    """Parse the reads kept during the stream, each with the time it was read."""
    t0 = now_ns()
    try:
        for t, chunk in reads:
            _parse(res, sse, chunk, t, chat, None, text)
    finally:
        reads.clear()
        res.parse_ns += now_ns() - t0


def _parse(res: ClientResult, sse: SSEDecoder, chunk: bytes, t: int, chat: bool,
           detok: Detokenizer | None, text: list[str]) -> None:
    """The events completed by one read (received at ``t``) into ``res``."""
    for data in sse.feed(chunk):
        if data == "[DONE]":
            res.ok = res.finish_reason is not None
            continue
        obj = json.loads(data)
        if "error" in obj:
            res.error = obj["error"].get("message", str(obj["error"]))
            continue
        res.response_id = obj.get("id", res.response_id)
        if obj.get("usage"):
            res.usage = obj["usage"]
        choices = obj.get("choices") or []
        has = False
        if choices:
            ch = choices[0]
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            ids = (ch.get("delta") or {}).get("token_ids") if chat else ch.get("token_ids")
            if piece:
                text.append(piece)
                has = True
            if ids:
                res.token_ids.extend(ids)
                if detok is None:
                    has = True  # a consumer of ids: the ids are the content
                else:  # content is what a reader sees: new text
                    before = detok.released
                    piece = detok.feed(ids)
                    if ch.get("finish_reason"):
                        piece += detok.finish()
                    res.t_detok.extend([now_ns()] * (detok.released - before))
                    text.append(piece)
                    has = has or bool(piece)
            if ch.get("finish_reason"):
                res.finish_reason = ch["finish_reason"]
        res.t_events.append(t)
        res.content.append(has)
