"""In-network MoE combine: the first switch sums one token's expert outputs.

REDUCE frames on :data:`COMBINE_FLOW`, addressed to a token's home worker,
carry ``offset`` tokens (int32 ids, then one vector each) from one rank, with
``key`` contributions expected below this switch for each. The contributors'
leaf sums them; a token whose contributions are all in goes on to its home,
those a frame completed in one frame; the sender gets one ACK per frame.
Finished sums are kept (bounded) for a home that lost one and asks again by
NACK: for one token when its timer runs out, or at once for every token of a sum
frame a switch trimmed on its way (``[congestion] trim``), named by its
header. See fabric.core.moe for the workers' side. A contribution counts only
for a home of the sender's own tenant (the sender is known by its port), and,
for a communicator's combine (the group id in the message id's top bits), only
when the sender and the home are both its members: another tenant's, or
another group's, partials, whatever message and stream ids they name, never
enter a sum (PERMISSION).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np

from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, NackCode, Op
from fabric.core.memory import AccessError
from fabric.core.programs import GROUP_MSG_BITS
from kernels.dtypes import DTYPES, byte_view
from switchd.core.context import SwitchContext
from switchd.core.multicast import Multicast
from switchd.core.service import Service

__all__ = ["COMBINE_FLOW", "COMBINE_KEPT", "Combine", "CombineStats"]

#: In-network MoE combine: REDUCE frames on this flow, addressed to a token's
#: home, are summed by the first switch (the contributors' leaf).
COMBINE_FLOW: Final = fr.COMBINE_FLOW
#: Finished per-token combine sums a switch keeps for the home to ask again.
COMBINE_KEPT: Final = 65536

_FLOAT_CODES: Final = frozenset({fr.DType.F32, fr.DType.F16, fr.DType.BF16})

#: (home, msg, stream, token)
SumKey = tuple[int, int, int, int]


@dataclass
class _Sum:
    """One token's partial sum at one switch."""

    total: np.ndarray  # float32
    seen: set[int]
    expected: int
    dtype: int
    result: np.ndarray | None = None


@dataclass(frozen=True)
class CombineStats:
    """Token sums open here, finished ones kept for a home to ask again, and sum
    frames sent again (a home asked: its timer ran out, or the frame came trimmed)."""

    open_sums: int
    done_kept: int
    resent: int = 0


class Combine(Service):
    """Per-token sums of MoE expert outputs, at the contributors' switch."""

    name: ClassVar[str] = "combine"
    ops: ClassVar[tuple[Op, ...]] = (Op.REDUCE, Op.NACK)

    def __init__(self, ctx: SwitchContext, groups: Multicast | None = None) -> None:
        super().__init__(ctx)
        self._groups = groups  # who is in which communicator (None: no check)
        self._open: dict[SumKey, _Sum] = {}
        self._done: OrderedDict[SumKey, _Sum] = OrderedDict()
        # the tokens of each sum frame sent, by (home, msg, stream, first token): a
        # home that got it trimmed names it by its header alone
        self._frames: OrderedDict[SumKey, tuple[int, ...]] = OrderedDict()
        self._resent = 0

    def claims(self, f: fr.Frame, port: bytes, speaker: int | None) -> bool:
        if f.flow != COMBINE_FLOW:
            return False
        if f.op is Op.REDUCE:
            return bool(f.key) and speaker is not None
        return f.dst == self.ctx.id  # a home asks for a sum again

    def handle(self, f: fr.Frame, port: bytes, header: Any, payload: Any, now: float) -> None:
        ctx = self.ctx
        if f.op is Op.NACK:
            if f.offset == NackCode.TRIMMED:  # a frame of ours cut on its way: all of it
                named = self._frames.get((f.src, f.msg, f.job, f.psn), ())
            else:  # the home's timer: one token it lacks
                named = (f.psn,)
            items = [(t, acc) for t in named
                     if (acc := self._done.get((f.src, f.msg, f.job, t))) is not None]
            if items:
                self._resent += 1
                self._send(f.src, f.msg, f.job, items)
            return
        home, n = f.dst, f.offset
        if home not in ctx.worker_ids:
            raise FrameError(NackCode.INVALID, f"combine for node {home}: not a worker")
        topo = ctx.topo
        if topo.tenant_of(f.src) != topo.tenant_of(home):
            ctx.counters.unauthorised += 1
            raise AccessError(NackCode.PERMISSION, f"node {f.src} may not contribute to the "
                              f"combine of node {home}: another tenant's")
        gid = f.msg >> GROUP_MSG_BITS & 0xFF
        if gid and self._groups is not None:
            members = self._groups.groups.get(gid)
            if members is None or f.src not in members or home not in members:
                ctx.counters.unauthorised += 1
                raise AccessError(NackCode.PERMISSION, f"node {f.src} may not contribute to "
                                  f"the combine of node {home} in group {gid}: not both "
                                  "members")
        if f.dtype not in _FLOAT_CODES or not 0 < f.key <= len(ctx.attached_ids) or n <= 0:
            raise FrameError(NackCode.INVALID,
                             f"combine frame: dtype {f.dtype}, {f.key} contributions, {n} tokens")
        dt = DTYPES[fr.DTYPE_NAMES[f.dtype]]
        vec_bytes, rest = divmod(f.length - 4 * n, n)
        if f.length <= 4 * n or rest or vec_bytes % dt.itemsize:
            raise FrameError(NackCode.INVALID, f"combine frame of {f.length} B for {n} tokens")
        raw = np.frombuffer(f.payload, np.uint8)
        tokens = raw[:4 * n].view(np.int32)
        vecs = raw[4 * n:].view(dt).reshape(n, -1)
        done_now: list[tuple[int, _Sum]] = []
        for t, v in zip(tokens.tolist(), vecs, strict=True):
            k = (home, f.msg, f.job, t)
            if k in self._done:
                continue  # a resent frame: this token is summed already
            acc = self._open.get(k)
            if acc is None:
                acc = self._open[k] = _Sum(np.zeros(v.size, np.float32), set(), f.key, f.dtype)
            if v.size != acc.total.size or f.key != acc.expected or f.dtype != acc.dtype:
                raise FrameError(NackCode.INVALID, f"combine of token {t}: contributions "
                                 "of different sizes or counts")
            if f.src not in acc.seen:
                acc.seen.add(f.src)
                acc.total += v
                ctx.counters.payload_copies += 1
            if len(acc.seen) >= acc.expected:
                del self._open[k]
                acc.result = acc.total.astype(dt)
                self._done[k] = acc
                done_now.append((t, acc))
        while len(self._done) > COMBINE_KEPT:
            self._done.popitem(last=False)
        while len(self._frames) > COMBINE_KEPT:
            self._frames.popitem(last=False)
        ctx.send(ctx.ident[f.src], fr.encode_header(  # key: the tokens' home
            Op.ACK, src=ctx.id, dst=f.src, flow=COMBINE_FLOW + 1, job=f.job, psn=f.psn,
            key=home, msg=f.msg, crc=True,  # echoing a congestion mark, for its policy
            flags=Flag.ECN if f.has(Flag.ECN) else Flag.NONE))
        if done_now:
            self._send(home, f.msg, f.job, done_now)

    def statistics(self) -> CombineStats:
        return CombineStats(open_sums=len(self._open), done_kept=len(self._done),
                            resent=self._resent)

    def _send(self, home: int, msg: int, stream: int, items: list[tuple[int, _Sum]]) -> None:
        """Finished sums of tokens of ``home``, in one frame."""
        ctx = self.ctx
        ids = np.array([t for t, _ in items], np.int32)
        # (a resend of part of a frame keeps the whole frame's record: asked for
        # again, it brings the whole frame, and the home ignores what it has)
        self._frames.setdefault((home, msg, stream, items[0][0]), tuple(t for t, _ in items))
        vecs = [acc.result for _, acc in items if acc.result is not None]
        body = np.concatenate([ids.view(np.uint8), *(byte_view(v) for v in vecs)])
        ctx.counters.results_sent += 1
        ctx.send(ctx.next_hop[home], fr.encode_header(
            Op.REDUCE, src=ctx.id, dst=home, flow=COMBINE_FLOW, job=stream, psn=int(ids[0]),
            offset=len(items), msg=msg, dtype=items[0][1].dtype, payload=body,
            crc=ctx.crc), body)
