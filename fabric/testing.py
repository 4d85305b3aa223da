"""Test helpers for the protocol core: a fake clock, an in-memory lossy link, a transfer loop.

Public, like ``trio.testing``: semfab's own tests use them, and so do the
simulated benchmarks (``semfab bench loss``) and anyone trying a new retransmit
policy. Everything here is pure and deterministic: time is a number the loop
advances to the next deadline, faults come from a seeded
:class:`~fabric.core.faults.FaultInjector`, so a run is reproducible to the bit.

::

    clock = FakeClock()
    fwd = MemoryLink(FaultInjector("loss=0.01,delay=5us", seed=1), clock, bandwidth_gbps=10)
    back = MemoryLink(FaultInjector("delay=5us", seed=1, stream="back"), clock)
    result = run_transfer(Sender(1), Receiver(1), [(i, 1024) for i in range(1000)],
                          fwd, back, clock)
    assert result.completed and result.delivered == list(range(1000))

or in one call: ``simulate_transfer("selective", "loss=0.01", messages=1000)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fabric.core.faults import FaultInjector, FaultSpec, FaultStats, parse_faults
from fabric.core.frame import Flag, FrameError, Op, decode, encode
from fabric.core.link import LinkPipeline
from fabric.core.reliability import (
    Ack,
    Receiver,
    ReceiverStats,
    Sender,
    SenderStats,
    Transmit,
)
from fabric.core.topology import LinkParams

__all__ = [
    "FakeClock",
    "LinkStats",
    "MemoryLink",
    "TransferResult",
    "run_transfer",
    "simulate_transfer",
]


class FakeClock:
    """A clock that only moves when told to (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def advance(self, dt: float) -> float:
        """Move forward by ``dt`` >= 0; return the new time."""
        if dt < 0:
            raise ValueError(f"a clock does not go back: advance({dt})")
        self.now += dt
        return self.now

    def advance_to(self, t: float) -> float:
        """Move forward to ``t`` (no-op when ``t`` is in the past); return the new time."""
        self.now = max(self.now, t)
        return self.now

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Counters of a :class:`MemoryLink` plus its injector's."""

    sent: int
    delivered: int
    in_flight: int
    faults: FaultStats


class MemoryLink:
    """A one-way in-memory link: frames go in, come out at their arrival time.

    Built on :class:`fabric.core.link.LinkPipeline`, the link model of both worlds:
    the injector decides loss, corruption, duplication, reordering and delay
    first; then, with ``bandwidth_gbps``, the link serialises each frame (queued
    behind earlier ones), so extra retransmissions cost time, as on a real link.
    """

    def __init__(
        self,
        injector: FaultInjector | None,
        clock: FakeClock,
        *,
        bandwidth_gbps: float | None = None,
        name: str = "link",
    ) -> None:
        if bandwidth_gbps is not None and bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps}")
        self.injector = injector if injector is not None else FaultInjector()
        self.clock = clock
        self.bandwidth_gbps = bandwidth_gbps
        self.name = name
        params = LinkParams(bandwidth_gbps=bandwidth_gbps) if bandwidth_gbps else None
        self.pipe = LinkPipeline(params, injector=self.injector)
        self._sent = 0
        self._delivered = 0

    def send(self, data: bytes) -> None:
        """Put one frame on the link at the clock's current time."""
        self._sent += 1
        self.pipe.push((data, None), self.clock.now)

    def next_delivery(self) -> float | None:
        """The earliest time something arrives (or a held frame is released)."""
        return self.pipe.get_timer()

    def receive(self, now: float | None = None) -> list[bytes]:
        """Frames that have arrived by ``now`` (default: the clock), in arrival order."""
        now = self.clock.now if now is None else now
        # a corrupted frame comes back split at its header: one contiguous frame again
        out = [bytes(h) + (bytes(p) if p is not None else b"") for h, p in self.pipe.pop_due(now)]
        self._delivered += len(out)
        return out

    def statistics(self) -> LinkStats:
        """Counters so far."""
        return LinkStats(self._sent, self._delivered, len(self.pipe), self.injector.statistics())


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of :func:`run_transfer` (times in simulated seconds)."""

    delivered: list[Any]
    completed: bool
    elapsed: float
    steps: int
    payload_bytes: int
    corrupt_dropped: int
    sender: SenderStats
    receiver: ReceiverStats
    forward: LinkStats
    backward: LinkStats

    @property
    def goodput_gbps(self) -> float:
        """Payload bits delivered per simulated second / 1e9."""
        return self.payload_bytes * 8 / self.elapsed / 1e9 if self.elapsed > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Useful frames / frames sent (first sends + retransmissions)."""
        total = self.sender.sent + self.sender.retransmitted
        return len(self.delivered) / total if total else 1.0

    @property
    def data_frames_lost(self) -> int:
        """Data frames the forward link dropped or corrupted (ground truth)."""
        return self.forward.faults.lost + self.corrupt_dropped

    @property
    def retransmit_ratio(self) -> float:
        """Retransmissions per data frame lost on the link (1.0 is ideal)."""
        lost = self.data_frames_lost
        return self.sender.retransmitted / lost if lost else float(self.sender.retransmitted)


def run_transfer(
    sender: Sender[Any],
    receiver: Receiver[Any],
    messages: Iterable[tuple[Any, int]],
    link_fwd: MemoryLink,
    link_back: MemoryLink,
    clock: FakeClock,
    max_steps: int = 1_000_000,
    *,
    src: int = 1,
    dst: int = 2,
    crc: bool = True,
) -> TransferResult:
    """Move ``messages`` (``(handle, size)`` pairs, one frame each) through a lossy link pair.

    Data frames are real WRITE frames (``size`` zero bytes of payload, CRC32C
    when ``crc``), ACK/NACK frames real ACK/NACK frames, so corruption is
    caught by the codec and dropped as the receiver would. Each step advances
    ``clock`` to the next deadline (link arrivals, sender RTO, receiver delayed
    ACK) and handles everything due. Stops when the sender is done, when
    nothing is left to happen, or after ``max_steps``. A
    :class:`~fabric.core.reliability.ReliabilityError` propagates.
    """
    flow = sender.flow
    handles: list[Any] = []
    sizes: list[int] = []
    for handle, size in messages:
        handles.append(handle)
        sizes.append(size)
    zeros = memoryview(bytes(max(sizes, default=0)))
    delivered: list[Any] = []
    payload_bytes = 0
    corrupt = 0
    start = clock.now

    def put(transmits: Sequence[Transmit[int]]) -> None:
        for t in transmits:
            flags = Flag.FIRST | Flag.LAST | t.flags
            link_fwd.send(
                encode(
                    Op.WRITE,
                    src=src,
                    dst=dst,
                    flow=flow,
                    psn=t.psn,
                    msg=t.handle,
                    flags=flags,
                    payload=zeros[: t.size],
                    crc=crc,
                )
            )

    def feedback(ack: Ack | None) -> None:
        if ack is not None:
            for f in ack.frames(src=dst, dst=src, flow=flow, crc=crc):
                link_back.send(f)

    put(sender.send_many(enumerate(sizes), clock.now))

    steps = 0
    while steps < max_steps and not sender.done:
        deadlines = [
            t
            for t in (
                link_fwd.next_delivery(),
                link_back.next_delivery(),
                sender.get_timer(),
                receiver.get_timer(),
            )
            if t is not None
        ]
        if not deadlines:
            break
        steps += 1
        now = clock.advance_to(min(deadlines))
        for data in link_fwd.receive(now):
            try:
                frame = decode(data)
            except FrameError:
                corrupt += 1  # header untrustworthy: drop, the sender's loss detection recovers
                continue
            if frame.op is not Op.WRITE or frame.flow != flow:
                corrupt += 1
                continue
            got, ack = receiver.handle_frame(frame.psn, frame.msg, now, flags=frame.flags)
            for d in got:
                delivered.append(handles[d.handle])
                payload_bytes += sizes[d.handle]
            feedback(ack)
        if (t := receiver.get_timer()) is not None and t <= now:
            feedback(receiver.handle_timer(now))
        for data in link_back.receive(now):
            try:
                frame = decode(data)
            except FrameError:
                continue
            if frame.op is Op.ACK:
                put(sender.handle_ack(frame.psn, frame.sack, now))
            elif frame.op is Op.NACK:
                put(sender.handle_nack(frame.psn, frame.nack_code, now))
        if (t := sender.get_timer()) is not None and t <= now:
            put(sender.handle_timer(now))
    return TransferResult(
        delivered=delivered,
        completed=sender.done and len(delivered) == len(handles),
        elapsed=clock.now - start,
        steps=steps,
        payload_bytes=payload_bytes,
        corrupt_dropped=corrupt,
        sender=sender.statistics(),
        receiver=receiver.statistics(),
        forward=link_fwd.statistics(),
        backward=link_back.statistics(),
    )


def simulate_transfer(
    policy: str = "selective",
    faults: str | FaultSpec | None = None,
    *,
    back_faults: str | FaultSpec | None = None,
    messages: int = 1000,
    size: int = 1024,
    seed: int = 0,
    bandwidth_gbps: float | None = 10.0,
    delay: str = "delay=5us",
    window_frames: int = 64,
    rto_initial: float = 0.001,
    rto_min: float = 0.0002,
    max_retries: int = 30,
    first_psn: int = 0,
    max_steps: int = 2_000_000,
) -> TransferResult:
    """One seeded transfer of ``messages`` frames of ``size`` bytes under ``policy``.

    ``faults`` apply to the data direction and ``back_faults`` to the ACK
    direction (None: the same spec as ``faults``); ``delay`` is the base
    propagation delay added to both unless a spec sets its own delay. The
    defaults model a 10 Gb/s link with a 5 µs one-way delay; RTO bounds are
    scaled to that RTT (tens of µs) rather than to a software stack.
    """
    fwd_spec = _with_delay(parse_faults(faults), delay)
    back_spec = _with_delay(parse_faults(faults if back_faults is None else back_faults), delay)
    clock = FakeClock()
    fwd = MemoryLink(
        FaultInjector(fwd_spec, seed, stream="fwd"), clock, bandwidth_gbps=bandwidth_gbps
    )
    back = MemoryLink(
        FaultInjector(back_spec, seed, stream="back"), clock, bandwidth_gbps=bandwidth_gbps
    )
    sender: Sender[int] = Sender(
        1,
        policy=policy,
        window_frames=window_frames,
        rto_initial=rto_initial,
        rto_min=rto_min,
        max_retries=max_retries,
        first_psn=first_psn,
        peer="sim-receiver",
        operation="simulated WRITE stream",
    )
    receiver: Receiver[int] = Receiver(
        1, policy=policy, window=window_frames, first_psn=first_psn, nack_interval=rto_min
    )
    return run_transfer(
        sender, receiver, [(i, size) for i in range(messages)], fwd, back, clock, max_steps
    )


def _with_delay(spec: FaultSpec, delay: str) -> FaultSpec:
    if spec.delay_us or spec.jitter_us or not delay:
        return spec
    base = parse_faults(delay)
    return replace(spec, delay_us=base.delay_us, jitter_us=base.jitter_us)
