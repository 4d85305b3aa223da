"""ZeroMQ plumbing shared by switch daemons, nodes and the launcher.

Thin on purpose: sockets, addresses, and the two-part frame send/receive. All
protocol decisions live in the pure modules (frame, aggregation, reliability).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

#: Payloads at least this large are sent zero-copy; smaller ones are copied.
#: A zero-copy send hands the buffer's release to pyzmq's garbage-collector
#: thread, which takes the GIL: at 64 KiB frames it held a third of a busy
#: process's samples, and copying made a 16 MiB WRITE stream 25-30% faster
#: (64 KiB frames) and 5-20% faster (128 KiB); at 256 KiB the two were even.
#: pyzmq's own default (zmq.COPY_THRESHOLD) is 64 KiB.
ZERO_COPY_MIN = 256 * 1024
#: High-water marks: windows are self-clocked by the protocols, so the socket
#: queues only need to hold one window; a large HWM avoids silent drops.
HWM = 1_000_000


#: Before blocking on a socket, poll it without blocking for this long: a
#: blocked process is woken by the scheduler (about 100 us here), a spinning
#: one sees the frame at once. Off by default: measured on 2 cores, 200 us of
#: spinning cut a 1-worker ina round trip from 283 to 182 us but slowed 16 MiB
#: allreduces by a third (spinners steal the cores the copies need).
#: SEMFAB_SPIN_US sets it.
SPIN_S = float(os.environ.get("SEMFAB_SPIN_US", "0")) / 1e6


def spin(sock: zmq.Socket, seconds: float = SPIN_S) -> bool:
    """Poll ``sock`` without blocking for up to ``seconds``; True once a frame is there."""
    if seconds <= 0:
        return False
    end = time.perf_counter() + seconds
    while True:
        if sock.poll(0):
            return True
        if time.perf_counter() >= end:
            return False


#: zmq's poll counts whole milliseconds. A wait shorter than SHORT_WAIT_S (a paced
#: sender's next frame, a link's next departure) naps NAP_S at a time instead,
#: checking for frames in between, so it ends within about a nap of its time
#: rather than up to 1 ms late.
SHORT_WAIT_S = 0.001
NAP_S = 100e-6


def nap_until(ready: Callable[[], bool], seconds: float) -> bool:
    """Check ``ready()`` every NAP_S for up to ``seconds``; True once it is."""
    end = time.perf_counter() + seconds
    while True:
        if ready():
            return True
        left = end - time.perf_counter()
        if left <= 0:
            return False
        time.sleep(min(left, NAP_S))


# plain ints: IntFlag arithmetic runs through the enum machinery (~1 us, and a
# spinning waiter asks several times per frame)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def has_frame(sock: zmq.Socket) -> bool:
    """True when a frame waits on ``sock`` (no system call, unlike ``poll(0)``)."""
    events = sock.getsockopt(_EVENTS)
    return bool(events & _POLLIN) if isinstance(events, int) else False


def spin_poll(sock: zmq.Socket, timeout_ms: int, spin_s: float = SPIN_S) -> bool:
    """True when ``sock`` has a frame within ``timeout_ms``; spins ``spin_s`` first."""
    return spin(sock, min(spin_s, timeout_ms / 1000)) or bool(sock.poll(timeout_ms))


def context(io_threads: int = 1) -> zmq.Context:
    """A fresh ZeroMQ context (one per process)."""
    ctx = zmq.Context(io_threads=io_threads)
    return ctx


def _tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    # Larger kernel buffers help the ipc/tcp pipes carry 64 KiB..4 MiB frames.
    sock.setsockopt(zmq.SNDBUF, 4 * 1024 * 1024)
    sock.setsockopt(zmq.RCVBUF, 4 * 1024 * 1024)


def router(ctx: zmq.Context, bind: str) -> zmq.Socket:
    """A ROUTER bound at ``bind`` that raises when a peer is unknown (not drop)."""
    sock = ctx.socket(zmq.ROUTER)
    _tune(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def dealer(ctx: zmq.Context, connect: str, identity: str) -> zmq.Socket:
    """A DEALER named ``identity`` connected to ``connect``."""
    sock = ctx.socket(zmq.DEALER)
    _tune(sock)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(connect)
    return sock


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on loopback (for tests and peers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def socket_dir() -> Path:
    """A short private folder for ipc:// sockets (their paths must stay < 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=f"semfab-{os.getpid()}-", dir="/tmp"))
