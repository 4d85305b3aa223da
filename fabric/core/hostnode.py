"""The host node's services: the host-staged parameter server (host-ps).

``HostAggregator`` is pure: it takes decoded host-ps messages and returns the
replies to send. The node process (fabric.emulation.node) feeds it from its socket.

A chunk's state is keyed by the group's incarnation id (random, handed out by
the switch when the group was made), its member set, the call and the chunk:
a chunk that names other members, or another incarnation, never meets the
group's own, so no peer outside the group (and no earlier incarnation of it)
can add to its sum or be answered from it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from fabric.core.frame import FrameError, NackCode

#: (incarnation, members, seq, chunk)
ChunkKey = tuple[int, tuple[int, ...], int, int]


@dataclass
class _Pending:
    acc: np.ndarray
    members: tuple[int, ...]
    seen: set[int] = field(default_factory=set)
    overflow: str = ""  # why the integer sum would wrap (then it is no sum)
    marked: set[int] = field(default_factory=set)  # members whose message came CE-marked
    arrived: dict[int, float] = field(default_factory=dict)  # member -> when its message came


@dataclass
class HostStats:
    """What the host aggregator did."""

    messages: int = 0
    completed: int = 0
    duplicates: int = 0
    copies: int = 0
    encodes: int = 0


class HostAggregator:
    """Sum host-ps chunks from every member; reply once all have arrived."""

    #: Completed chunks whose reply is kept, so a member that lost it and sends its
    #: chunk again gets the reply again (counted once).
    KEPT = 4096
    #: Chunks in progress at once; beyond, a new one is refused NO_RESOURCE (the
    #: sender retries) so a flood of chunks that never complete cannot grow it.
    PENDING_MAX = 65536

    def __init__(self) -> None:
        self._pending: dict[ChunkKey, _Pending] = {}
        self._done: OrderedDict[ChunkKey, tuple[frozenset[int], bytes]] = OrderedDict()
        self.stats = HostStats()

    def on_message(self, src: int, body: bytes | memoryview, ce: bool = False,
                   now: float = 0.0) -> list[tuple[int, bytes]]:
        """Handle one host-ps message from node ``src`` at ``now``; returns
        ``[(dst, reply)]``.

        The reply is each member's ACK for its message, for its congestion control:
        it names the members whose message arrived congestion experienced (``ce``:
        ``Flag.ECN``) and, per member, how long the host held its message waiting
        for the others (``held``, seconds; the way a QUIC ACK carries its ACK
        delay), so that wait is not read as queueing on the way."""
        from kernels.dtypes import UFUNCS, byte_view, np_dtype
        from kernels.reference import first_wrap

        try:
            m: dict[str, Any] = msgpack.unpackb(body)
            seq, chunk = int(m["seq"]), int(m["chunk"])
            members = tuple(int(v) for v in m["members"])
            inc = int(m.get("inc", 0))
            reduce = UFUNCS[m["op"]]
            data = np.frombuffer(m["data"], dtype=np_dtype(m["dtype"]))
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise FrameError(NackCode.MALFORMED, f"bad host-ps message: {exc}") from None
        if not members or len(set(members)) != len(members):
            raise FrameError(NackCode.MALFORMED, f"host-ps seq {seq}: members must be distinct")
        if src not in members:
            raise FrameError(NackCode.PERMISSION, f"node {src} is not a member of seq {seq}")
        self.stats.messages += 1
        self.stats.encodes += 1  # unpack
        self.stats.copies += 1  # unpack copied the payload out of the message
        key = (inc, tuple(sorted(members)), seq, chunk)
        kept = self._done.get(key)
        if kept is not None:  # our reply was lost: send it again, to this member only
            self.stats.duplicates += 1
            return [(src, kept[1])] if src in kept[0] else []
        p = self._pending.get(key)
        if p is None:
            if len(self._pending) >= self.PENDING_MAX:
                raise FrameError(NackCode.NO_RESOURCE,
                                 f"host-ps: {self.PENDING_MAX} chunks in progress")
            p = self._pending[key] = _Pending(np.array(data, copy=True), key[1])
        elif src in p.seen:
            self.stats.duplicates += 1
            return []
        else:
            if data.size != p.acc.size or data.dtype != p.acc.dtype:
                raise FrameError(NackCode.INVALID,
                                 f"chunk {chunk} sizes or dtypes differ between members")
            at = first_wrap(p.acc, data) if m["op"] == "sum" and not p.overflow else None
            if at is not None:  # never wrap silently: every member is told
                p.overflow = (f"{data.dtype} sum would wrap at element {at} of chunk "
                              f"{chunk}")
            if not p.overflow:
                reduce(p.acc, data, out=p.acc)
        self.stats.copies += 1  # into the accumulator
        p.seen.add(src)
        p.arrived[src] = now
        if ce:
            p.marked.add(src)
        if len(p.seen) < len(p.members):
            return []
        del self._pending[key]
        n = len(p.members)
        # Per member chunk, what the host did: unpack + accumulate, plus a share
        # of the one reply it packs for everybody.
        reply = msgpack.packb({"seq": seq, "chunk": chunk, "data": byte_view(p.acc).data,
                               "overflow": p.overflow, "ce": sorted(p.marked),
                               # [member, seconds] pairs (msgpack keys are strings)
                               "held": [[m, max(now - t, 0.0)] for m, t in p.arrived.items()],
                               "h_copies": 2 + 1 / n, "h_encodes": 1 + 1 / n})
        self.stats.encodes += 1
        self.stats.copies += 1
        self.stats.completed += 1
        self._done[key] = (frozenset(p.members), reply)
        while len(self._done) > self.KEPT:
            self._done.popitem(last=False)
        return [(member, reply) for member in p.members]
