"""Posts: bytes a worker hands to another node in the background, reliably.

A decoding leader hands each step's tokens to host0 over the front-end and goes
on with the next step at once; a checkpointing rank streams its state to host0
beside it. Neither waits for the delivery, yet both deliveries are frames on
the links, queued behind each other and behind everything else those links
carry. :class:`Outbox` is the sending side (one reliable stream per destination
node, selective repeat under the path's congestion policy, the same
:class:`~fabric.core.reliability.Sender` a stream uses); :class:`Inbox` the
receiving side (a :class:`~fabric.core.reliability.Receiver` per sender, every
frame ACKed, and the time each post was whole). Both are pure: frames and
``now`` in, frames and timers out.

A sender keeps one stream per destination and *channel* (``job``): posts on
one channel go in order, those on others beside them (a checkpoint on its own
channel does not hold up the tokens on theirs). A post's frames are WRITEs on
:data:`POST_FLOW` (ACKs and NACKs on the next flow): ``msg`` numbers the post
(per sender), ``offset`` is the frame's place in it and ``key`` the post's
size, so the receiver knows when it has it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from fabric.core import frame as fr
from fabric.core.frame import Flag, Op
from fabric.core.reliability import Receiver, Sender
from fabric.errors import UsageError

__all__ = ["POST_FLOW", "Inbox", "InboxStats", "Outbox", "PostArrival"]

#: The flow of posts' WRITEs; their ACKs and NACKs travel on POST_FLOW + 1. A
#: switch trims a post's frame rather than drop it (the frame codec's
#: ``trimmable``); the receiving node answers the cut header with a TRIMMED NACK
#: (``NodeState.answer_trimmed``) and the sender resends it at once.
POST_FLOW: Final = fr.POST_FLOW
#: Frames of one destination's posts in flight at most (a stream's window).
POST_WINDOW_FRAMES: Final = 64
#: The receiver's window of PSNs it accepts ahead of the next expected one.
POST_RECEIVER_WINDOW: Final = 4096

Send = tuple[bytes, Any]


_ZEROS: dict[int, bytes] = {}


def _zeros(n: int) -> bytes:
    """A shared zero payload of ``n`` bytes (posts are timing-only)."""
    z = _ZEROS.get(n)
    if z is None:
        z = _ZEROS[n] = bytes(n)
    return z


@dataclass(frozen=True)
class PostArrival:
    """A post whole at its receiver: from node ``src`` on ``channel``, its number,
    its size, when."""

    src: int
    post: int
    nbytes: int
    t: float
    channel: int = 0


@dataclass(frozen=True)
class InboxStats:
    """What an inbox received."""

    frames: int
    duplicates: int
    posts: int


class Outbox:
    """One node's posts to other nodes (``st``: its :class:`NodeState`)."""

    def __init__(self, st: Any) -> None:
        self.st = st
        self._senders: dict[tuple[int, int], Sender[int]] = {}  # (dst, channel)
        self._frames: dict[int, tuple[int, int, int, int]] = {}  # handle -> post, off, n, size
        self._next_frame = 0
        self.posts = 0

    def post(self, dst: int, nbytes: int, now: float, channel: int = 0
             ) -> tuple[int, list[Send]]:
        """Post ``nbytes`` (timing-only: zero bytes of that size) to node ``dst`` on
        ``channel``; returns the post's number and the frames to send now."""
        st = self.st
        if not 1 <= nbytes <= fr.MAX_PAYLOAD:  # (its size travels in a 32-bit field)
            raise UsageError(f"{st.name}: a post needs nbytes from 1 to {fr.MAX_PAYLOAD}, "
                             f"not {nbytes}")
        if dst == st.node_id or not 0 <= dst < len(st.topo.nodes) \
                or st.topo.by_id(dst).is_switch:
            raise UsageError(f"{st.name}: post to node id {dst}: not another worker or host")
        if not 0 <= channel <= 0xFFFF:
            raise UsageError(f"{st.name}: post channel {channel}: 0..65535")
        sender = self._senders.get((dst, channel))
        if sender is None:
            if st.path_congestion(dst).cc == "eqds":
                raise UsageError(
                    f"{st.name}: a post to {st.topo.by_id(dst).name} crosses links under "
                    "eqds, whose receivers grant credit; a post's receiver grants none: "
                    "choose another cc for that network class")
            sender = self._senders[(dst, channel)] = st.stream_sender(
                POST_FLOW, dst, policy="selective", window_frames=POST_WINDOW_FRAMES,
                frame_bytes=st.stream_frame_bytes, operation="post", key=channel)
        n = self.posts
        self.posts += 1
        fb = st.stream_frame_bytes
        burst = []
        for off in range(0, nbytes, fb):
            h = self._next_frame
            self._next_frame += 1
            size = min(fb, nbytes - off)
            self._frames[h] = (n, off, size, nbytes)
            burst.append((h, size))
        return n, self._put((dst, channel), sender.send_many(burst, now))

    def _put(self, where: tuple[int, int], transmits: list[Any]) -> list[Send]:
        out: list[Send] = []
        st = self.st
        dst, channel = where
        for t in transmits:
            post, off, n, total = self._frames[t.handle]
            part = _zeros(n)
            out.append((fr.encode_header(Op.WRITE, src=st.node_id, dst=dst, flow=POST_FLOW,
                                         job=channel, psn=t.psn, msg=post & 0xFFFF_FFFF,
                                         offset=off,
                                         key=total, flags=t.flags, payload=part,
                                         crc=st.crc), part))
        return out

    def wants(self, f: fr.Frame) -> bool:
        """An ACK or NACK of our posts."""
        return f.flow == POST_FLOW + 1 and (f.src, f.job) in self._senders and (
            f.op is Op.ACK or f.op is Op.NACK)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        """Take an ACK or NACK (:meth:`wants`); frames to send again."""
        where = (f.src, f.job)
        sender = self._senders[where]
        if f.op is Op.ACK:
            out = sender.handle_ack(f.psn, f.sack, now, f.has(Flag.ECN))
        else:
            out = sender.handle_nack(f.psn, f.offset, now)
        self._forget(sender)
        self.st.retransmits += sum(1 for t in out if t.retransmit)
        return self._put(where, out)

    def _forget(self, sender: Sender[int]) -> None:
        for h in sender.pop_acked():
            self._frames.pop(h, None)

    def get_timer(self) -> float | None:
        """The earliest retransmit deadline of any destination."""
        due: float | None = None
        for s in self._senders.values():
            d = s.get_timer()
            if d is not None and (due is None or d < due):
                due = d
        return due

    def handle_timer(self, now: float) -> list[Send]:
        """Resend what timed out (RetryLimitExceeded when a destination is gone)."""
        out: list[Send] = []
        for where, s in self._senders.items():
            d = s.get_timer()
            if d is not None and d <= now:
                resent = s.handle_timer(now)
                self.st.retransmits += sum(1 for t in resent if t.retransmit)
                out += self._put(where, resent)
        return out

    @property
    def done(self) -> bool:
        """Every post acknowledged."""
        return all(s.done for s in self._senders.values())


class Inbox:
    """The posts a node receives (``node_id``: its id): each frame ACKed, and the
    time each post was whole (:attr:`arrivals`)."""

    def __init__(self, node_id: int, crc: bool = False) -> None:
        self.node_id = node_id
        self.crc = crc
        self._receivers: dict[tuple[int, int], Receiver[tuple[int, int, int]]] = {}
        self._have: dict[tuple[int, int], int] = {}  # (src, post) -> bytes so far
        self.arrivals: list[PostArrival] = []
        self._frames = 0

    @staticmethod
    def wants(f: fr.Frame) -> bool:
        """A post's frame."""
        return f.flow == POST_FLOW and f.op is Op.WRITE

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        """Take a post's frame; the ACK (and gap NACK) to send back."""
        self._frames += 1
        rx = self._receivers.get((f.src, f.job))
        if rx is None:
            rx = self._receivers[(f.src, f.job)] = Receiver(
                POST_FLOW, ordered=False, ack_every=1, window=POST_RECEIVER_WINDOW)
        delivered, ack = rx.handle_frame(f.psn, (f.msg, f.length, f.key), now, flags=f.flags)
        for d in delivered:
            post, n, total = d.handle
            key = (f.src, post)
            got = self._have.get(key, 0) + n
            if got >= total:
                self._have.pop(key, None)
                self.arrivals.append(PostArrival(f.src, post, total, now, f.job))
            else:
                self._have[key] = got
        if ack is None:
            return []
        return [(h, None) for h in ack.frames(src=self.node_id, dst=f.src, job=f.job,
                                             flow=POST_FLOW + 1, crc=self.crc)]

    def statistics(self) -> InboxStats:
        """A frozen snapshot."""
        dups = sum(r.statistics().duplicates for r in self._receivers.values())
        return InboxStats(frames=self._frames, duplicates=dups, posts=len(self.arrivals))
