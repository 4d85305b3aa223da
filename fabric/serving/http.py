"""The presentation layer's driver: an aiohttp application around :class:`TokenHost`.

Routes (OpenAI-compatible, plus two of semfab's own):

* ``GET  /v1/models``
* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed as
  server-sent events with ``"stream": true``, one JSON body otherwise
* ``GET  /health``
* ``GET  /metrics`` -- Prometheus text format: per-layer latency histograms,
  TTFT and end-to-end histograms, request and token counters
* ``GET  /semfab/stats`` -- the host's live counters
* ``POST /semfab/shutdown`` -- stop the chain (needs the run's secret in the
  ``X-Semfab-Secret`` header; the launcher uses it)

Every error is an OpenAI error object with its HTTP status, including unknown
routes (404) and wrong methods (405). :func:`serve` is host0's task: the
:class:`TokenHost` behind this application, until the chain shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
from aiohttp import web

from fabric.errors import UsageError
from fabric.serving import api, eventloop, prom
from fabric.serving.clock import now_ns
from fabric.serving.config import ServeConfig
from fabric.serving.host import Event, Stream, TokenHost

log = logging.getLogger("semfab.serving.http")

HOST_KEY = web.AppKey("host", object)
#: The fast path writes only while the socket's send buffer holds less than this.
FAST_WRITE_LIMIT = 64 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def port_in_use(host: str, port: int) -> str:
    """The one-line message for a port another process listens on."""
    return (f"port {port} is in use on {host}: stop what listens there or choose another "
            "--port (0: any free port)")


def check_listen(host: str, port: int) -> None:
    """UsageError now if the server could not listen on ``host:port`` (0: any port).

    Binds and closes a socket on every address ``host`` resolves to, with the
    options the server itself uses, so a busy port is reported before the
    fabric is launched. A race with another process is still caught when the
    server binds.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UsageError(port_in_use(host, port)) from None
                raise UsageError(f"--host {host} --port {port}: cannot listen there "
                                 f"({exc.strerror or exc})") from None


def _json(obj: Any, status: int = 200) -> web.Response:
    text = json.dumps(obj, ensure_ascii=False)
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:
        # a client's lone surrogate quoted back in an error: \u escapes are valid JSON
        body = json.dumps(obj).encode("ascii")
    return web.Response(body=body, status=status, content_type="application/json",
                        charset="utf-8")


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every refusal into an OpenAI error object with the right status."""
    try:
        return await handler(request)
    except api.ApiError as exc:
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = api.ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                           code="not_found" if exc.status == 404 else None)
        resp = _json(err.body(), exc.status)
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return _json(api.ApiError(500, "Internal server error", type_="server_error").body(),
                     500)


def _host(request: web.Request) -> TokenHost:
    host: TokenHost = request.app[HOST_KEY]  # type: ignore[assignment]
    return host


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    host = _host(request)
    return _json(api.models_list(host.models, host.created))


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while serving, 503 while shutting down."""
    host = _host(request)
    return _json({"status": "closing" if host.closing else "ok"}, 503 if host.closing else 200)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the Prometheus text exposition format."""
    body = _host(request).metrics.render()
    return web.Response(body=body.encode(), headers={"Content-Type": prom.CONTENT_TYPE})


async def stats(request: web.Request) -> web.Response:
    """``GET /semfab/stats``."""
    return _json(_host(request).stats())


async def shutdown(request: web.Request) -> web.Response:
    """``POST /semfab/shutdown`` with the run's secret."""
    host = _host(request)
    given = request.headers.get("X-Semfab-Secret", "")
    if not host.cfg.secret or not hmac.compare_digest(given, host.cfg.secret):
        raise api.ApiError(403, "shutdown needs the run's secret", type_="permission_error")
    host.request_stop()
    return _json({"status": "stopping"})


async def _body(request: web.Request) -> Any:
    return api.parse_json(await request.read())


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    host = _host(request)
    req = api.parse_completion(await _body(request), host.models, host.cfg.max_tokens_limit)
    return await _generate(request, host, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    host = _host(request)
    req = api.parse_chat(await _body(request), host.models, host.cfg.max_tokens_limit)
    return await _generate(request, host, req)


async def _generate(request: web.Request, host: TokenHost, req: api.GenRequest
                    ) -> web.StreamResponse:
    st = host.open(req)
    completed = False
    try:
        if req.stream:
            resp = await _stream(request, host, st)
        else:
            resp = await _collect(host, st)
        completed = st.delivered
        return resp
    finally:
        host.close_stream(st, completed)


async def _collect(host: TokenHost, st: Stream) -> web.Response:
    """Non-streaming: gather every event, answer one JSON object."""
    text: list[str] = []
    ids: list[int] = []
    finish = None
    while finish is None:
        for ev in await host.next_events(st, host.cfg.token_timeout_s):
            if ev.error is not None:
                raise ev.error
            text.append(ev.text)
            if ev.ids is not None:
                ids.extend(ev.ids)
            if ev.finish is not None:
                finish = ev.finish
    st.delivered = True
    body = api.completion_response(st.response_id, st.req.model, st.created, "".join(text),
                                   finish, st.prompt_tokens, st.received, st.req.kind,
                                   ids if st.detok is None else None)
    return _json(body)


def _event_bytes(host: TokenHost, st: Stream, fmt: api.ChunkFormatter, ev: Event
                 ) -> tuple[bytes, int, bool]:
    """SSE bytes of one event (+ usage and [DONE] after the last); its event index."""
    parts = [fmt.delta(ev.text, ev.ids, ev.finish)]
    chunk = fmt.events - 1
    end = ev.finish is not None
    if end:
        if st.req.include_usage:
            parts.append(fmt.usage(st.prompt_tokens, st.received))
        parts.append(api.DONE)
    return (parts[0] if len(parts) == 1 else b"".join(parts)), chunk, end


def _fast_sink(request: web.Request, host: TokenHost, st: Stream,
               fmt: api.ChunkFormatter) -> Callable[[Event], bool] | None:
    """Write events straight to the connection from the token handler.

    The fast path of the presentation layer: the event is formatted and
    handed to the socket inside the callback that detokenized it, instead of
    waking the request's handler task (a task switch and aiohttp's writer per
    event). It frames HTTP/1.1 chunks itself, so it is only used once the
    response is prepared with chunked encoding, and only while the socket's
    send buffer is nearly empty; otherwise events go through the handler,
    whose aiohttp writer applies back-pressure.
    """
    transport = request.transport
    if not host.cfg.fast_write or transport is None or request.version < (1, 1):
        return None

    def sink(ev: Event) -> bool:
        if transport.is_closing() or transport.get_write_buffer_size() > FAST_WRITE_LIMIT:
            return False  # the handler takes over (and notices a closed client)
        data, chunk, end = _event_bytes(host, st, fmt, ev)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        host.stamp_written(st, ev, chunk, now_ns())
        if end:
            st.delivered = True
            st.wake()
        return True

    return sink


async def _stream(request: web.Request, host: TokenHost, st: Stream) -> web.StreamResponse:
    """Streaming: one SSE event per delta, written as soon as it exists."""
    resp = web.StreamResponse(status=200, headers=api.SSE_HEADERS)
    if request.version >= (1, 1):
        resp.enable_chunked_encoding()
    await resp.prepare(request)
    fmt = api.ChunkFormatter(st.req.kind, st.response_id, st.req.model, st.created)
    if st.req.kind == "chat":
        await resp.write(fmt.role())
    st.sink = _fast_sink(request, host, st, fmt)
    timeout = host.cfg.token_timeout_s
    try:
        while not st.delivered:
            events = await host.next_events(st, timeout)
            if not events:
                continue  # woken by the fast path
            parts: list[bytes] = []
            stamps: list[tuple[Event, int]] = []
            end = False
            failed = False
            for ev in events:
                if ev.error is not None:
                    parts += [api.error_event(ev.error), api.DONE]
                    failed = end = True
                    break
                data, chunk, end = _event_bytes(host, st, fmt, ev)
                parts.append(data)
                stamps.append((ev, chunk))
                if end:
                    break
            await resp.write(parts[0] if len(parts) == 1 else b"".join(parts))
            t = now_ns()
            for ev, chunk in stamps:
                host.stamp_written(st, ev, chunk, t)
            if end:
                st.delivered = not failed
                break
        st.sink = None
        await resp.write_eof()
    except (ConnectionError, RuntimeError) as exc:
        # the client went away mid-stream: the caller aborts the sequence
        log.info("stream %s: client gone (%s)", st.response_id, type(exc).__name__)
    finally:
        st.sink = None
    return resp


def make_app(host: TokenHost) -> web.Application:
    """The aiohttp application serving ``host``."""
    app = web.Application(middlewares=[openai_errors], client_max_size=4 * 1024 * 1024)
    app[HOST_KEY] = host
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/semfab/stats", stats)
    app.router.add_post("/semfab/shutdown", shutdown)
    return app


def _write_ready(cfg: ServeConfig, info: dict[str, Any]) -> None:
    if cfg.ready_file:
        tmp = Path(cfg.ready_file + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, cfg.ready_file)  # atomic: the launcher never reads half a file


async def _serve(ep: Any, cfg: ServeConfig) -> dict[str, Any]:
    host = TokenHost(ep, cfg)
    loop = host.loop
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, host.request_stop)
    parent = os.getppid()

    async def watchdog() -> None:
        while not host.stopped.done():
            await asyncio.sleep(0.5)
            if os.getppid() != parent:
                log.warning("host0: launcher went away")
                host.request_stop()

    dog = loop.create_task(watchdog())
    url = ""
    runner = web.AppRunner(make_app(host), access_log=None, handle_signals=False,
                           shutdown_timeout=1.0)
    try:
        await host.start()
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:  # the launcher reports it in one line
            error = port_in_use(cfg.host, cfg.port) if exc.errno == errno.EADDRINUSE else \
                f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc})"
            _write_ready(cfg, {"error": error})
            await host.shutdown()
            return {**host.result(), "url": "", "error": error}
        addr = runner.addresses[0]
        url = f"http://{addr[0]}:{addr[1]}"
        _write_ready(cfg, {"url": url, "pid": os.getpid()})
        log.info("host0: serving %s at %s", cfg.label(), url)
        await host.stopped
        await host.shutdown()
    finally:
        dog.cancel()
        await runner.cleanup()
        with contextlib.suppress(Exception):
            loop.remove_reader(ep.sock.getsockopt(zmq.FD))
        host._close_bells()
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGTERM)
    out = host.result()
    out["url"] = url
    return out


def serve(ep: Any, cfg: ServeConfig) -> dict[str, Any]:
    """Host task: run the chain's host side until shut down; return counters and timelines."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return eventloop.run(_serve(ep, cfg))
    finally:
        signal.signal(signal.SIGTERM, previous)  # the node's own handler, for after the task
