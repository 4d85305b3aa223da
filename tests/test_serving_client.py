"""The streaming client: events timed when read, parsed inline or after the stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fabric.serving.client import stream_request  # noqa: E402

GAP_S = 0.03  # between the server's events: far above the client's own per-event cost


def _event(i: int, last: bool) -> bytes:
    obj = {"id": "cmpl-1", "choices": [{"text": f"t{i} ", "token_ids": [i],
                                        "finish_reason": "length" if last else None}]}
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _serve(cut_after: int | None, n: int) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if cut_after is not None and i == cut_after:
                assert request.transport is not None
                request.transport.close()  # the server goes away mid-stream
                return resp
            # an event split across two writes: the client must join them
            ev = _event(i, i == n - 1)
            await resp.write(ev[:7])
            await resp.write(ev[7:])
            await asyncio.sleep(GAP_S)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/completions"


def _run(cut_after: int | None, n: int, **kw: Any) -> Any:
    async def main() -> Any:
        runner, url = await _serve(cut_after, n)
        try:
            async with aiohttp.ClientSession() as s:
                return await stream_request(s, url, {"prompt": "x", "stream": True}, **kw)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


@pytest.mark.parametrize("inline", [False, True], ids=["after-stream", "inline"])
def test_every_event_timed_when_read_and_parsed(inline: bool) -> None:
    n = 7
    res = _run(None, n, stop_after_events=100 if inline else None)
    assert res.ok and res.error is None
    assert res.text == "".join(f"t{i} " for i in range(n))
    assert res.token_ids == list(range(n))
    assert res.finish_reason == "length"
    assert len(res.t_events) == n and all(res.content)
    gaps = [b - a for a, b in zip(res.t_events, res.t_events[1:], strict=False)]
    # each event's time is when it was read, not when it was parsed
    assert all(g >= GAP_S * 0.8e9 for g in gaps), gaps
    assert res.parse_ns > 0


def test_a_stream_cut_short_keeps_what_came_before() -> None:
    res = _run(3, 7)
    assert not res.ok
    assert res.error is not None
    assert res.token_ids == [0, 1, 2]
    assert len(res.t_events) == 3


def test_a_character_split_across_reads_and_crlf_line_ends_are_joined() -> None:
    """The SSE decoding: a UTF-8 character cut between two reads, CRLF, a comment."""
    obj = {"id": "cmpl-1", "choices": [{"text": "é€", "token_ids": [1],
                                        "finish_reason": "length"}]}
    wire = f": hi\r\n\r\ndata: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n".encode()
    cut = wire.index("€".encode()) + 1  # inside the character's three bytes

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(wire[:cut])
        await asyncio.sleep(GAP_S)
        await resp.write(wire[cut:] + b"data: [DONE]\r\n\r\n")
        return resp

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:
                return await stream_request(s, url, {"prompt": "x", "stream": True})
        finally:
            await runner.cleanup()

    res = asyncio.run(main())
    assert res.ok and res.error is None
    assert res.text == "é€" and res.token_ids == [1] and len(res.t_events) == 1
    assert res.t_events[0] - res.t_send >= GAP_S * 0.8e9  # timed by the read that completed it
