"""TokenHost against a real ZeroMQ socket pair, no fabric: how it reads its socket."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Op
from fabric.serving import assets
from fabric.serving import records as rec
from fabric.serving.config import ServeConfig
from fabric.serving.host import TokenHost

HOST, WORKER, SESSION = 1, 7, 0x5EED


class FakeEndpoint:
    """What TokenHost uses of a fabric endpoint; its socket's peer is ``peer``."""

    def __init__(self, ctx: zmq.Context[Any], name: str) -> None:
        self.node_id = HOST
        self.topo = SimpleNamespace(workers=[SimpleNamespace(id=WORKER, name="w0")])
        self.regions: list[Any] = []
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.bind(f"inproc://{name}")
        self.peer = ctx.socket(zmq.DEALER)
        self.peer.connect(f"inproc://{name}")

    def send_frame(self, header: bytes, payload: Any = None) -> None:
        self.sock.send(header)

    def alloc(self, n: int, dtype: str) -> np.ndarray:
        return np.zeros(n, dtype)

    def region_of(self, arr: np.ndarray) -> None:
        return None  # plain memory: the host keys its ring itself


def ctrl(t: str, **fields: Any) -> bytes:
    return fr.encode(Op.CTRL, src=WORKER, dst=HOST,
                     payload=control.pack(t, session=SESSION, **fields))


@pytest.fixture
def endpoint(request: pytest.FixtureRequest):
    ctx: zmq.Context[Any] = zmq.Context()
    ep = FakeEndpoint(ctx, request.node.name)
    yield ep
    ep.sock.close(0)
    ep.peer.close(0)
    ctx.term()


def test_a_frame_that_came_before_a_send_from_a_timer_is_still_read(
        tmp_path: Path, endpoint: FakeEndpoint) -> None:
    """A send takes the socket's read signal: the host must drain after any send.

    Here a frame arrives while the event loop is busy, then a re-ask timer
    sends a NACK before the loop looks at the socket again. Without a drain
    after that send the frame would wait (and its stream stall) until some
    other frame came: a lost token's stream hung for good this way.
    """
    cfg = ServeConfig(backend="numpy", assets_dir=str(assets.ensure_assets(tmp_path)),
                      session=SESSION)

    async def main() -> None:
        endpoint.peer.send(ctrl(rec.READY, worker="w0", bell=""))
        host = TokenHost(endpoint, cfg)
        await host.start(timeout_s=5)
        assert WORKER in host._ready_workers
        while endpoint.peer.poll(0):
            endpoint.peer.recv()  # the CONFIG
        host._missing[(WORKER, 0)] = (0, 1)  # asked for once, long ago
        endpoint.peer.send(ctrl(rec.STOPPED))
        time.sleep(0.05)  # the loop is busy; the frame lands and signals the socket
        host._on_reask()  # the timer fires first: NACK frame 0 again
        nack = fr.decode(endpoint.peer.recv())
        assert nack.op is Op.NACK and nack.psn == 0
        for _ in range(20):
            if WORKER in host._stopped:
                break
            await asyncio.sleep(0.01)
        assert WORKER in host._stopped  # the frame that came first was read
        host._close_bells()
        if host._reask is not None:
            host._reask.cancel()

    asyncio.run(main())
