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
    from fabric.core.congestion.settings import CongestionSettings
    from fabric.core.topology import LinkParams, Topology

__all__ = ["SwitchQueues", "switch_queues"]


@dataclass
class SwitchQueues:
    """One switch's buffer and ECN marker (None: it never marks); ``lossless``
    (PFC): every frame is admitted, and senders are paused instead of frames
    dropped."""

    buffer: TimedBuffer
    marker: RedMarker | None
    lossless: bool = False  # PFC: pause senders instead of dropping


def switch_queues(topo: Topology, seed: int = 0) -> dict[tuple[str, str], SwitchQueues]:
    """Every switch's queues, by ``(switch, link class)``: the queues of the switch's
    ports whose link is of that class (absent: unbounded). Classes with the same
    settings share one buffer, so without ``[congestion.<class>]`` tables each
    switch has one, shared by all its ports; a class with its own table gets a
    buffer of its own (its ``buffer_bytes``), its own marking and its own PFC.

    Raises :class:`~fabric.core.congestion.CongestionConfigError` (one line) for a
    buffer that cannot hold one frame of its links' largest MTU."""
    from fabric.core import frame as fr
    from fabric.core.congestion.config import CongestionConfigError

    out: dict[tuple[str, str], SwitchQueues] = {}
    fabric_wide = topo.congestion.for_class(None)
    largest = max(lk.params.mtu for lk in topo.links) + fr.HEADER_SIZE + fr.CRC_SIZE
    for s in topo.switches:
        links = topo.links_of(s.name)
        by_settings: dict[CongestionSettings, list[str]] = {}
        for lk in links:
            c = topo.link_congestion(lk)
            classes = by_settings.setdefault(c, [])
            if lk.cls not in classes:
                classes.append(lk.cls)
        for c, classes in by_settings.items():
            if c.buffer_bytes is None:
                continue
            if c.buffer_bytes < largest:
                where = "[congestion]" if c == fabric_wide else f"[congestion.{classes[0]}]"
                raise CongestionConfigError(
                    f"{where} buffer_bytes {c.buffer_bytes} cannot hold one frame ({largest} B: "
                    "the links' largest MTU with its header); raise it")
            mine = [lk.params for lk in links if lk.cls in classes]
            tag = "" if len(by_settings) == 1 else "/" + "+".join(classes)
            q = _queues(c, mine, largest, random.Random(f"{seed}/{s.name}{tag}/ecn"))
            for cls in classes:
                out[(s.name, cls)] = q
    return out


def _queues(c: CongestionSettings, links: list[LinkParams], largest: int,
            rng: random.Random) -> SwitchQueues:
    """The buffer, marker and PFC accounting of settings ``c`` over ``links``."""
    size = c.buffer_bytes if c.buffer_bytes is not None else 0
    bdp = size / (HTSIM_QUEUE_BDP_TRIM if c.trim else HTSIM_QUEUE_BDP_DROP)
    marks = c.cc is not None or any(v is not None for v in
                                    (c.ecn_kmin_bytes, c.ecn_kmax_bytes, c.ecn_pmax))
    kmin = c.ecn_kmin_bytes if c.ecn_kmin_bytes is not None else int(HTSIM_ECN_KMIN_BDP * bdp)
    kmax = c.ecn_kmax_bytes if c.ecn_kmax_bytes is not None else max(
        int(HTSIM_ECN_KMAX_BDP * bdp), kmin)
    pmax = c.ecn_pmax if c.ecn_pmax is not None else 1.0
    # trimmed headers get room of their own: a pool full of data still takes them
    reserve = 64 * TRIM_HEADER_BYTES if c.trim else 0
    buf = SharedBuffer(size + reserve, alpha=c.buffer_alpha,
                       trim_bytes=TRIM_HEADER_BYTES if c.trim else 0,
                       trim_reserve_bytes=reserve, what="[congestion] buffer_bytes")
    marker = RedMarker(kmin, kmax, pmax, rng) if marks else None
    pfc = None
    if c.pfc:
        rate_delay = max((p.bandwidth_gbps * 1e9 / 8 * p.latency_us * 1e-6 for p in links),
                         default=0.0)
        headroom = max(int(HPCC_HEADROOM_LINK_DELAYS * rate_delay), 2 * largest)
        pfc = PfcIngress(mtu=largest, headroom_bytes=headroom, alpha=HPCC_PFC_ALPHA,
                         resume_offset_bytes=2 * largest)
    return SwitchQueues(TimedBuffer(buf, pfc), marker, lossless=c.pfc)
