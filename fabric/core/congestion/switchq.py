"""Each switch's queues as a topology's ``[congestion]`` table sets them, for the
link pipelines of both worlds (the simulator's and the switch daemon's).

A switch gets a shared buffer when the table has ``buffer_bytes``: its egress
ports' queues draw on it (dynamic threshold ``buffer_alpha``); a frame that does
not fit is dropped at the tail or, with ``trim``, cut to its header, which
jumps the data queue (:mod:`fabric.core.link`). With a buffer, a switch marks
ECN (RED on the port's data queue) when the table names a policy (``cc``) or an
``ecn_*`` key; thresholds it does not name keep htsim's proportions: its buffer
is 5 BDP (1 with trimming) and it marks from 0.2 to 0.8 BDP, every frame above.

With ``pfc`` the buffer is lossless: it drops nothing, and counts what each
ingress port holds (:class:`~fabric.core.congestion.pfc.PfcIngress`: XOFF at
1/8 of the free buffer, HPCC's dynamic threshold; XON two frames lower; a
headroom of three times the fastest link's rate x delay, at least two
frames). Above XOFF the link the frame came on is paused until that port's
frames drain to XON (:mod:`fabric.core.link`; the drivers apply the pause).
One lossless class carries every frame. A credit-controlled link (its
``credit``, or ``[congestion] credit`` for every link) has no queue here: it
waits for credit instead of overflowing (:mod:`fabric.core.link`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabric.core.congestion.buffer import SharedBuffer
from fabric.core.congestion.config import (
    HPCC_HEADROOM_LINK_DELAYS,
    HPCC_PFC_ALPHA,
    HTSIM_ECN_KMAX_BDP,
    HTSIM_ECN_KMIN_BDP,
    HTSIM_QUEUE_BDP_DROP,
    HTSIM_QUEUE_BDP_TRIM,
    TRIM_HEADER_BYTES,
)
from fabric.core.congestion.ecn import RedMarker
from fabric.core.congestion.pfc import PfcIngress
from fabric.core.congestion.timed import TimedBuffer

if TYPE_CHECKING:
    from fabric.core.topology import Topology

__all__ = ["SwitchQueues", "switch_queues"]


@dataclass
class SwitchQueues:
    """One switch's buffer and ECN marker (None: it never marks); ``lossless``
    (PFC): every frame is admitted, and senders are paused instead of frames
    dropped."""

    buffer: TimedBuffer
    marker: RedMarker | None
    lossless: bool = False  # PFC: pause senders instead of dropping


def switch_queues(topo: Topology, seed: int = 0) -> dict[str, SwitchQueues]:
    """Every switch's queues by name (none without ``[congestion] buffer_bytes``).

    Raises :class:`~fabric.core.congestion.CongestionConfigError` (one line) for a
    buffer that cannot hold one frame of the links' largest MTU."""
    from fabric.core import frame as fr
    from fabric.core.congestion.config import CongestionConfigError

    c = topo.congestion
    if c.buffer_bytes is None:
        return {}
    largest = max(lk.params.mtu for lk in topo.links) + fr.HEADER_SIZE + fr.CRC_SIZE
    if c.buffer_bytes < largest:
        raise CongestionConfigError(
            f"[congestion] buffer_bytes {c.buffer_bytes} cannot hold one frame ({largest} B: "
            "the links' largest MTU with its header); raise it")
    bdp = c.buffer_bytes / (HTSIM_QUEUE_BDP_TRIM if c.trim else HTSIM_QUEUE_BDP_DROP)
    marks = c.cc is not None or any(v is not None for v in
                                    (c.ecn_kmin_bytes, c.ecn_kmax_bytes, c.ecn_pmax))
    kmin = c.ecn_kmin_bytes if c.ecn_kmin_bytes is not None else int(HTSIM_ECN_KMIN_BDP * bdp)
    kmax = c.ecn_kmax_bytes if c.ecn_kmax_bytes is not None else max(
        int(HTSIM_ECN_KMAX_BDP * bdp), kmin)
    pmax = c.ecn_pmax if c.ecn_pmax is not None else 1.0
    out: dict[str, SwitchQueues] = {}
    for s in topo.switches:
        # trimmed headers get room of their own: a pool full of data still takes them
        reserve = 64 * TRIM_HEADER_BYTES if c.trim else 0
        buf = SharedBuffer(c.buffer_bytes + reserve, alpha=c.buffer_alpha,
                           trim_bytes=TRIM_HEADER_BYTES if c.trim else 0,
                           trim_reserve_bytes=reserve, what="[congestion] buffer_bytes")
        marker = RedMarker(kmin, kmax, pmax, random.Random(f"{seed}/{s.name}/ecn")) \
            if marks else None
        pfc = None
        if c.pfc:
            links = [lk.params for lk in topo.links if s.name in lk.endpoints]
            rate_delay = max((p.bandwidth_gbps * 1e9 / 8 * p.latency_us * 1e-6 for p in links),
                             default=0.0)
            headroom = max(int(HPCC_HEADROOM_LINK_DELAYS * rate_delay), 2 * largest)
            pfc = PfcIngress(mtu=largest, headroom_bytes=headroom, alpha=HPCC_PFC_ALPHA,
                             resume_offset_bytes=2 * largest)
        out[s.name] = SwitchQueues(TimedBuffer(buf, pfc), marker, lossless=c.pfc)
    return out
