"""The host node's services: the host-staged parameter server (host-ps).

``HostAggregator`` is pure: it takes decoded host-ps messages and returns the
replies to send. The node process (fabric.emulation.node) feeds it from its socket.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from fabric.core.frame import FrameError, NackCode


@dataclass
class _Pending:
    acc: np.ndarray
    members: list[int]
    seen: set[int] = field(default_factory=set)


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

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._done: OrderedDict[tuple[int, int], tuple[frozenset[int], bytes]] = OrderedDict()
        self.stats = HostStats()

    def on_message(self, src: int, body: bytes | memoryview) -> list[tuple[int, bytes]]:
        """Handle one host-ps message from node ``src``; returns ``[(dst, reply)]``."""
        from kernels.dtypes import UFUNCS, byte_view, np_dtype

        try:
            m: dict[str, Any] = msgpack.unpackb(body)
            seq, chunk, members = int(m["seq"]), int(m["chunk"]), [int(v) for v in m["members"]]
            reduce = UFUNCS[m["op"]]
            data = np.frombuffer(m["data"], dtype=np_dtype(m["dtype"]))
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise FrameError(NackCode.MALFORMED, f"bad host-ps message: {exc}") from None
        if src not in members:
            raise FrameError(NackCode.PERMISSION, f"node {src} is not a member of seq {seq}")
        self.stats.messages += 1
        self.stats.encodes += 1  # unpack
        self.stats.copies += 1  # unpack copied the payload out of the message
        key = (seq, chunk)
        kept = self._done.get(key)
        if kept is not None:  # our reply was lost: send it again, to this member only
            self.stats.duplicates += 1
            return [(src, kept[1])] if src in kept[0] else []
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(np.array(data, copy=True), members)
        elif src in p.seen:
            self.stats.duplicates += 1
            return []
        else:
            if data.size != p.acc.size or data.dtype != p.acc.dtype:
                raise FrameError(NackCode.MALFORMED,
                                 f"chunk {chunk} sizes or dtypes differ between members")
            reduce(p.acc, data, out=p.acc)
        self.stats.copies += 1  # into the accumulator
        p.seen.add(src)
        if len(p.seen) < len(p.members):
            return []
        del self._pending[key]
        n = len(p.members)
        # Per member chunk, what the host did: unpack + accumulate, plus a share
        # of the one reply it packs for everybody.
        reply = msgpack.packb({"seq": seq, "chunk": chunk, "data": byte_view(p.acc).data,
                               "h_copies": 2 + 1 / n, "h_encodes": 1 + 1 / n})
        self.stats.encodes += 1
        self.stats.copies += 1
        self.stats.completed += 1
        self._done[key] = (frozenset(p.members), reply)
        while len(self._done) > self.KEPT:
            self._done.popitem(last=False)
        return [(member, reply) for member in p.members]
