"""PFC's two classic failures, in virtual time: a victim of head-of-line blocking,
and a deadlock on a cyclic topology, detected.

* :func:`run_victim`: ``senders`` hosts on switch ``s1`` send an incast to host
  ``r`` on switch ``s2``; one more host on ``s1``, the victim, sends to ``r2``, an
  idle host on ``s2``. The ``s1``-``s2`` link is fast enough for everyone, so only
  ``r``'s port is congested. With PFC, ``s2`` pauses ``s1``'s whole data class on
  that link, and the victim waits behind frames it has nothing to do with; with
  trimming instead, it does not. With credit-based link flow control (``credit``)
  the victim waits too: ``s1``'s credits for ``s2`` are spent on frames queued for
  ``r``, so the victim's frames behind them do not go.
* :func:`run_ring`: three switches in a ring, a host on each; every host sends
  to the host two switches on, clockwise. Each switch's ring ingress fills with
  frames for the next ring link; with PFC and a small XOFF they pause each
  other in a cycle and nothing moves again. :class:`~fabric.sim.network.PfcWatchdog`
  finds the cycle of paused ports and the run ends with it in ``deadlock``.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import numpy as np

from fabric.core.congestion import CcPath, PfcIngress, RedMarker, SharedBuffer, make_cc
from fabric.core.congestion.config import (
    HPCC_BUFFER_BYTES,
    HPCC_HEADROOM_LINK_DELAYS,
    HPCC_PFC_ALPHA,
    HTSIM_MTU,
    TRIM_HEADER_BYTES,
    bdp_bytes,
)
from fabric.core.congestion.credit import CreditLink, link_credit_bytes
from fabric.sim.figures import count_wrong
from fabric.sim.network import CONTROL_WIRE_BYTES, Net, PfcWatchdog, Port, Switch
from fabric.sim.transport import Host, ReceiverFlow, SenderFlow

__all__ = ["run_ring", "run_victim"]

#: Links' latency (one way) and rate of the hosts' links.
LATENCY_S = 1e-6
LINK_GBPS = 100.0
#: The watchdog looks every this many base RTTs; a class paused longer than
#: ``WATCHDOG_RTTS`` base RTTs is stuck.
WATCHDOG_PERIOD_RTTS = 5
WATCHDOG_RTTS = 50
#: A run that has not finished after this long (virtual) is reported as such.
LIMIT_S = 1.0
#: The victim case's switches: a 1 MB shared buffer under a dynamic threshold of
#: alpha 1 (a queue may take as much as is free), small enough for PFC to pause.
VICTIM_BUFFER_BYTES = 1_000_000
DT_ALPHA = 1.0


def _kick(port: Port, t: float) -> None:
    port.kick(t)


def _pfc(mtu: int, rate_gbps: float, xoff_bytes: int | None) -> PfcIngress:
    headroom = max(int(HPCC_HEADROOM_LINK_DELAYS * rate_gbps * 1e9 / 8 * LATENCY_S), 2 * mtu)
    if xoff_bytes is None:
        return PfcIngress(mtu=mtu, headroom_bytes=headroom, alpha=HPCC_PFC_ALPHA,
                          resume_offset_bytes=mtu)
    return PfcIngress(mtu=mtu, headroom_bytes=headroom, xoff_bytes=xoff_bytes,
                      resume_offset_bytes=mtu)


def _connect(a: Switch, b: Switch, rate_bps: float) -> tuple[Port, Port]:
    pa, pb = a.add_port(rate_bps, LATENCY_S), b.add_port(rate_bps, LATENCY_S)
    pa.connect(b, pb.index)
    pb.connect(a, pa.index)
    return pa, pb


def _port_to(sw: Switch, node: Host) -> int:
    """The port of ``sw`` whose link leads to ``node``."""
    return next(p.index for p in sw.ports if p.peer is node)


def _host(net: Net, sw: Switch, hid: int, rate_bps: float) -> Host:
    h = Host(net, f"h{hid}", hid)
    nic = h.attach(rate_bps, LATENCY_S)
    port = sw.add_port(rate_bps, LATENCY_S)
    nic.connect(sw, port.index)
    port.connect(h, 0)
    return h


def _flow(src: Host, dst: Host, size: int, cc: str, path: CcPath, rto: float,
          seed: int) -> tuple[SenderFlow, ReceiverFlow]:
    data = np.frombuffer(np.random.default_rng((seed, src.hid)).bytes(size), np.uint8)
    f = SenderFlow(src.hid, src, dst.hid, data, path.mtu, make_cc(cc, path), rto)
    src.add_sender(f)
    rx = ReceiverFlow(src.hid, src.hid, size, path.mtu)
    dst.receivers[src.hid] = rx
    return f, rx


def _base_rtt(hops: int, mtu: int) -> float:
    return hops * 2 * (LATENCY_S + (mtu + 64) * 8 / (LINK_GBPS * 1e9))


def run_victim(*, pfc: bool, credit: bool = False, senders: int = 8, size: int = 500_000,
               victim_size: int = 200_000, cc: str = "none",
               buffer_bytes: int = VICTIM_BUFFER_BYTES, mtu: int = HTSIM_MTU,
               seed: int = 0) -> dict[str, Any]:
    """The victim flow's completion time beside the incast's, with PFC, credit-based
    link flow control (``credit``) or trimming.

    With PFC or trimming both switches share ``buffer_bytes`` among their ports
    under a dynamic threshold (alpha 1), PFC's headroom on top and XOFF at 1/8
    of the free buffer. With credits each link's far end grants a round trip of
    the link at its rate, and a switch's buffer is what it granted."""
    wall0 = time.perf_counter()
    net = Net()
    rate = LINK_GBPS * 1e9
    rtt = _base_rtt(3, mtu)
    bdp = bdp_bytes(LINK_GBPS, rtt)
    trim = not pfc and not credit
    marker = RedMarker(int(0.2 * bdp), int(0.8 * bdp), 1.0, random.Random(seed + 1))
    host_credits = link_credit_bytes(LINK_GBPS, LATENCY_S, mtu, CONTROL_WIRE_BYTES)
    fast_credits = link_credit_bytes(LINK_GBPS * (senders + 1), LATENCY_S, mtu,
                                     CONTROL_WIRE_BYTES)

    def switch(name: str, host_links: int) -> Switch:
        if credit:
            sw = Switch(net, name, SharedBuffer(host_links * host_credits + fast_credits,
                                                alpha=math.inf), marker=marker)
            sw.credit = True
            return sw
        if pfc:
            ingress = _pfc(mtu, LINK_GBPS * (senders + 1), None)
            reserve = (senders + 3) * ingress.headroom
            sw = Switch(net, name, SharedBuffer(buffer_bytes + reserve, alpha=DT_ALPHA),
                        marker=marker, pfc=ingress)
            sw.pfc_reserve = reserve
            return sw
        headers = 64 * TRIM_HEADER_BYTES
        return Switch(net, name, SharedBuffer(buffer_bytes + headers, alpha=DT_ALPHA,
                                              trim_bytes=TRIM_HEADER_BYTES,
                                              trim_reserve_bytes=headers),
                      marker=marker, trim=True)

    s1, s2 = switch("s1", senders + 1), switch("s2", 2)
    up, down = _connect(s1, s2, rate * (senders + 1))
    hosts = [_host(net, s1, i, rate) for i in range(senders + 1)]  # the last is the victim
    r, r2 = _host(net, s2, senders + 1, rate), _host(net, s2, senders + 2, rate)
    for h in hosts:
        s1.routes[h.hid] = [_port_to(s1, h)]
        s2.routes[h.hid] = [down.index]
    for h in (r, r2):
        s1.routes[h.hid] = [up.index]
        s2.routes[h.hid] = [_port_to(s2, h)]
    if credit:
        for sw in (s1, s2):
            for port in sw.ports:
                port.credit = CreditLink(fast_credits if port in (up, down) else host_credits,
                                         mtu=mtu)
        for h in (*hosts, r, r2):
            h.nic.credit = CreditLink(host_credits, mtu=mtu)
            h.returns_credit = True
    path = CcPath(link_gbps=LINK_GBPS, base_rtt_s=rtt, mtu=mtu, trimming=trim)
    # a frame may wait for a whole buffer to drain ahead of it: no resend before that
    rto = max(4 * rtt, rtt + 2 * buffer_bytes * 8 / rate)
    flows = [_flow(h, r, size, cc, path, rto, seed) for h in hosts[:-1]]
    victim = _flow(hosts[-1], r2, victim_size, cc, path, rto, seed)
    for h in hosts:
        net.at(0.0, _kick, h.nic)
    net.pending = senders + 1
    done = net.run(lambda: net.pending == 0, LIMIT_S)
    incast_end = max((rx.done_at or net.now) for _f, rx in flows)
    v_fct = victim[1].done_at if victim[1].done_at is not None else net.now
    v_alone = (victim[0].wire_bytes * 8 / rate + 2 * LATENCY_S
               + victim[0].wire_size(0) * 8 / rate * 2)
    ports = [p for sw in (s1, s2) for p in sw.ports] + [h.nic for h in hosts]
    return {
        "scenario": "pfc-victim", "pfc": pfc, "credit": credit,
        "mode": "pfc" if pfc else "credit" if credit else "trim", "finished": done,
        "victim_fct_s": v_fct, "victim_alone_s": v_alone, "victim_slowdown": v_fct / v_alone,
        "incast_completion_s": incast_end,
        "pauses": sum(p.pause.pauses for p in ports),
        "paused_s": sum(p.pause.paused_s(net.now) for p in ports),
        "uplink_paused_s": up.pause.paused_s(net.now),
        "uplink_credit_stalled_s": up.credit.stalled(net.now) if up.credit else 0.0,
        "trims": s1.buffer.trims + s2.buffer.trims, "drops": s1.buffer.drops + s2.buffer.drops,
        "wrong": count_wrong([*flows, victim]),
        "settings": {"senders": senders, "size": size, "victim_size": victim_size, "cc": cc,
                     "buffer_bytes": buffer_bytes, "buffer_alpha": DT_ALPHA, "mtu": mtu,
                     "link_gbps": LINK_GBPS, "latency_us": LATENCY_S * 1e6, "seed": seed},
        "events": net.events, "wall_s": time.perf_counter() - wall0,
    }


def run_ring(*, xoff_bytes: int = 4 * HTSIM_MTU, size: int = 2_000_000, cc: str = "none",
             mtu: int = HTSIM_MTU, seed: int = 0) -> dict[str, Any]:
    """Three switches in a ring under PFC, every flow two hops clockwise: deadlock,
    found by the watchdog (``deadlock``: the cycle of paused ports), or not."""
    wall0 = time.perf_counter()
    net = Net()
    rate = LINK_GBPS * 1e9
    rtt = _base_rtt(3, mtu)
    sws = []
    for i in range(3):
        sw = Switch(net, f"s{i}", SharedBuffer(HPCC_BUFFER_BYTES),
                    pfc=_pfc(mtu, LINK_GBPS, xoff_bytes))
        sws.append(sw)
    cw = [_connect(sws[i], sws[(i + 1) % 3], rate)[0] for i in range(3)]  # clockwise ports
    hosts = [_host(net, sws[i], i, rate) for i in range(3)]
    for i, sw in enumerate(sws):
        for h in hosts:
            # the local host directly; every other one clockwise (never the short way)
            sw.routes[h.hid] = [_port_to(sw, h)] if h.hid == i else [cw[i].index]
    path = CcPath(link_gbps=LINK_GBPS, base_rtt_s=rtt, mtu=mtu)
    rto = 1.0  # lossless: a resend would only add to the jam
    flows = [_flow(hosts[i], hosts[(i + 2) % 3], size, cc, path, rto, seed) for i in range(3)]
    for h in hosts:
        net.at(0.0, _kick, h.nic)
    net.pending = 3
    dog = PfcWatchdog(net, sws, WATCHDOG_PERIOD_RTTS * rtt, WATCHDOG_RTTS * rtt)
    done = net.run(lambda: net.pending == 0 or dog.deadlock is not None, LIMIT_S)
    return {
        "scenario": "pfc-ring", "finished": done and net.pending == 0,
        "deadlock": dog.deadlock, "detected_at_s": net.now if dog.deadlock else None,
        "delivered_bytes": sum(rx.count * rx.chunk for _f, rx in flows),
        "pauses": sum(p.pause.pauses for sw in sws for p in sw.ports),
        "lossless_drops": sum(sw.lossless_drops for sw in sws),
        "settings": {"xoff_bytes": xoff_bytes, "size": size, "cc": cc, "mtu": mtu,
                     "seed": seed},
        "events": net.events, "wall_s": time.perf_counter() - wall0,
    }
