"""The permutation scenario: every host sends to another, on a leaf/spine, in virtual time.

``leaves x per_leaf`` hosts hang off their leaf switch at ``link_gbps``; each leaf
has one uplink to each of ``spines`` spine switches, of ``per_leaf x link_gbps /
(oversubscription x spines)`` each. Every host sends ``size`` bytes to the host a
seeded random permutation (no host to itself) gives it, all starting at t = 0.
Leaves spread a flow's frames over the uplinks by **ECMP** (one uplink per flow,
by hash: flows may collide) or, with ``spray``, **per frame** at random (no
collisions; frames reorder, which the receivers take: they keep per-frame state,
not a sequence). Every port has its own queue of ``buffer`` bytes (htsim's
queues: 1 BDP with trimming, 5 without), ECN from 0.2 to 0.8 BDP.

Figures as for the incast (:mod:`fabric.sim.incast`); ``ideal_s`` is the most
loaded of a host link and a leaf's uplinks (or downlinks) at its rate, plus the
first frame's way.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fabric.core import frame as fr
from fabric.core.congestion import (
    CcPath,
    CongestionConfigError,
    RedMarker,
    SharedBuffer,
    get_cc,
    make_cc,
)
from fabric.core.congestion.config import (
    HTSIM_ECN_KMAX_BDP,
    HTSIM_ECN_KMIN_BDP,
    HTSIM_LINK_GBPS,
    HTSIM_MTU,
    HTSIM_QUEUE_BDP_DROP,
    HTSIM_QUEUE_BDP_TRIM,
    TRIM_HEADER_BYTES,
    bdp_bytes,
    check_bytes,
)
from fabric.core.congestion.dcqcn import CnpPacer
from fabric.core.congestion.eqds import CreditPacer
from fabric.sim.figures import count_wrong, jain, slowdowns
from fabric.sim.network import CONTROL_WIRE_BYTES, Net, Port, Switch
from fabric.sim.transport import Host, ReceiverFlow, SenderFlow

__all__ = ["PermutationSettings", "run_permutation"]

#: As in the incast: the retransmission timer's floor in base RTTs, a stalled run's
#: limit in ideal times, and the trimmed headers each port keeps room for.
RTO_MIN_RTTS = 4.0
STALL_IDEALS = 200.0
TRIM_RESERVE_HEADERS = 64
#: Typo guards on the fabric's size.
MAX_HOSTS = 65535
MAX_SPINES = 1024


@dataclass(frozen=True)
class PermutationSettings:
    """Everything one permutation run depends on (reported with its results)."""

    leaves: int
    per_leaf: int
    spines: int
    size: int  # bytes per host
    oversubscription: float = 1.0
    link_gbps: float = HTSIM_LINK_GBPS
    latency_us: float = 1.0  # every link, one way
    mtu: int = HTSIM_MTU
    cc: str = "nscc"
    spray: bool = False
    trim: bool = False
    buffer: int | None = None  # bytes per port; None: 1 BDP with trim, 5 without
    ecn: bool = True
    seed: int = 0

    @property
    def hosts(self) -> int:
        return self.leaves * self.per_leaf

    @property
    def uplink_gbps(self) -> float:
        return self.per_leaf * self.link_gbps / (self.oversubscription * self.spines)

    @property
    def base_rtt_s(self) -> float:
        """An MTU frame host - leaf - spine - leaf - host and its ACK back."""
        lat = self.latency_us / 1e6
        rates = (self.link_gbps, self.uplink_gbps, self.uplink_gbps, self.link_gbps)
        return sum(2 * lat + (self.mtu + CONTROL_WIRE_BYTES) * 8 / (r * 1e9) for r in rates)

    @property
    def bdp(self) -> int:
        return bdp_bytes(self.link_gbps, self.base_rtt_s)

    def resolved(self) -> PermutationSettings:
        """Defaults filled in and checked; a one-line error for an impossible one."""
        for name, v, hi in (("--leaves", self.leaves, MAX_HOSTS),
                            ("--per-leaf", self.per_leaf, MAX_HOSTS),
                            ("--spines", self.spines, MAX_SPINES)):
            if not 1 <= v <= hi:
                raise CongestionConfigError(f"{name} {v}: must be 1..{hi}")
        if self.hosts < 2 or self.hosts > MAX_HOSTS:
            raise CongestionConfigError(f"{self.hosts} hosts: a permutation needs 2..{MAX_HOSTS}")
        if not (math.isfinite(self.oversubscription) and 1 <= self.oversubscription <= 64):
            raise CongestionConfigError(f"--oversubscription {self.oversubscription}: must be "
                                        "1..64")
        check_bytes("--size", self.size, minimum=1)
        if not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
            raise CongestionConfigError(f"--link-gbps {self.link_gbps}: must be positive")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise CongestionConfigError(f"--latency-us {self.latency_us}: must be >= 0")
        check_bytes("--mtu", self.mtu, minimum=fr.HEADER_SIZE + 1, maximum=1 << 24)
        get_cc(self.cc)
        buffer = self.buffer if self.buffer is not None else int(
            (HTSIM_QUEUE_BDP_TRIM if self.trim else HTSIM_QUEUE_BDP_DROP) * self.bdp)
        check_bytes("--buffer", buffer)
        if buffer < self.mtu:
            raise CongestionConfigError(f"--buffer {buffer} B per port holds no frame of one "
                                        f"MTU ({self.mtu} B); give at least that")
        return dataclasses.replace(self, buffer=buffer)


def _kick(port: Port, t: float) -> None:
    port.kick(t)


def _derangement(n: int, rng: random.Random) -> list[int]:
    """A random permutation of range(n) with no fixed point."""
    while True:
        p = list(range(n))
        rng.shuffle(p)
        if all(i != v for i, v in enumerate(p)):
            return p


#: Ports whose queues a recorded run keeps: the fullest switch-to-switch ones.
HOT_PORTS = 4


def run_permutation(settings: PermutationSettings,
                    record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Simulate one permutation; the figures of :func:`fabric.sim.incast.run_incast`.

    ``record`` (a dict) gets ``queues``: the data queue over time (``[(t, bytes)]``)
    of the HOT_PORTS fullest ports between leaves and spines, where ECMP's
    collisions queue (recording every such port costs memory on large runs)."""
    s = settings.resolved()
    assert s.buffer is not None
    wall0 = time.perf_counter()
    net = Net()
    rng = random.Random(s.seed)
    rate, up = s.link_gbps * 1e9, s.uplink_gbps * 1e9
    lat = s.latency_us / 1e6
    bdp = s.bdp
    marker = (RedMarker(int(HTSIM_ECN_KMIN_BDP * bdp), int(HTSIM_ECN_KMAX_BDP * bdp), 1.0,
                        random.Random(s.seed + 1)) if s.ecn else None)
    reserve = TRIM_RESERVE_HEADERS * TRIM_HEADER_BYTES if s.trim else 0

    def port_buffer() -> SharedBuffer:
        return SharedBuffer(s.buffer + reserve, alpha=math.inf,  # type: ignore[operator]
                            trim_bytes=TRIM_HEADER_BYTES if s.trim else 0,
                            trim_reserve_bytes=reserve)

    def switch(name: str) -> Switch:
        sw = Switch(net, name, SharedBuffer(0), marker=marker, trim=s.trim,
                    rng=random.Random(rng.random()))
        sw.spray = s.spray
        return sw

    leaves = [switch(f"leaf{i}") for i in range(s.leaves)]
    spines = [switch(f"spine{i}") for i in range(s.spines)]
    hosts = [Host(net, f"h{i}", i) for i in range(s.hosts)]
    for h in hosts:
        leaf = leaves[h.hid // s.per_leaf]
        nic = h.attach(rate, lat)
        port = leaf.add_port(rate, lat, port_buffer())
        nic.connect(leaf, port.index)
        port.connect(h, 0)
    fabric_ports = []
    for leaf in leaves:
        for sp in spines:
            a = leaf.add_port(up, lat, port_buffer())
            b = sp.add_port(up, lat, port_buffer())
            a.connect(sp, b.index)
            b.connect(leaf, a.index)
            fabric_ports += [a, b]
    if record is not None:
        for p in fabric_ports:
            p.depth = []
    for li, leaf in enumerate(leaves):
        uplinks = list(range(s.per_leaf, s.per_leaf + s.spines))
        for h in hosts:
            local = h.hid // s.per_leaf == li
            leaf.routes[h.hid] = [h.hid % s.per_leaf] if local else uplinks
    for sp in spines:
        for h in hosts:
            sp.routes[h.hid] = [h.hid // s.per_leaf]
    path = CcPath(link_gbps=s.link_gbps, base_rtt_s=s.base_rtt_s, mtu=s.mtu, trimming=s.trim)
    policy = get_cc(s.cc)
    rto = max(RTO_MIN_RTTS * s.base_rtt_s, s.base_rtt_s + 6 * s.buffer * 8 / up)
    dst = _derangement(s.hosts, rng)
    flows: list[SenderFlow] = []
    rxs: list[ReceiverFlow] = []
    for h in hosts:
        data = np.frombuffer(np.random.default_rng((s.seed, h.hid)).bytes(s.size), np.uint8)
        f = SenderFlow(h.hid, h, dst[h.hid], data, s.mtu, make_cc(s.cc, path), rto)
        h.add_sender(f)
        flows.append(f)
        peer = hosts[dst[h.hid]]
        rx = ReceiverFlow(h.hid, h.hid, s.size, s.mtu)
        peer.receivers[h.hid] = rx
        rxs.append(rx)
        if policy.wants_cnp:
            peer.cnp = CnpPacer()
        if policy.receiver_driven:
            peer.credit = CreditPacer(s.link_gbps, s.mtu)
            peer.unsolicited_bytes = int(f.cc.credit)
        net.at(0.0, _kick, h.nic)
    net.pending = s.hosts
    # the busiest of: a host link, a leaf's uplinks, a leaf's downlinks from the spines
    wire = flows[0].wire_bytes
    cross_out = [0] * s.leaves
    cross_in = [0] * s.leaves
    for i, d in enumerate(dst):
        if i // s.per_leaf != d // s.per_leaf:
            cross_out[i // s.per_leaf] += wire
            cross_in[d // s.per_leaf] += wire
    uplink_total = up * s.spines
    first_hop = 2 * lat + flows[0].wire_size(0) * 8 / rate
    ideal = max(wire * 8 / rate, max(cross_out + cross_in) * 8 / uplink_total) + first_hop
    done = net.run(lambda: net.pending == 0, STALL_IDEALS * ideal + 1.0)
    wall = time.perf_counter() - wall0
    end = max((rx.done_at or net.now) for rx in rxs)
    fcts = [(rx.done_at if rx.done_at is not None else end) for rx in rxs]
    alone = [f.wire_bytes * 8 / rate + first_hop for f in flows]
    switches = leaves + spines
    pools = [b for sw in switches for b in sw.buffers]
    ports = [h.nic for h in hosts] + [p for sw in switches for p in sw.ports]
    if record is not None:
        hot = sorted(fabric_ports, key=lambda p: p.peak_bytes, reverse=True)[:HOT_PORTS]
        record["queues"] = {p.name: p.depth for p in hot if p.peak_bytes}
        record["pauses"] = {}
    return {
        "scenario": "permutation",
        "finished": done,
        "completion_s": end,
        "ideal_s": ideal,
        "of_ideal": end / ideal,
        "fct_slowdown": slowdowns(fcts, alone),
        "fct_p99_s": sorted(fcts)[max(math.ceil(0.99 * len(fcts)) - 1, 0)],
        "goodput_gbps": s.hosts * s.size * 8 / end / 1e9 if end > 0 else 0.0,
        "jain": jain([f.size / fct for f, fct in zip(flows, fcts, strict=True)]),
        "drops": sum(b.drops for b in pools),
        "trims": sum(b.trims for b in pools),
        "ecn_marks": sum(sw.ecn_marks for sw in switches),
        "pauses": sum(p.pause.pauses for p in ports),
        "paused_s": sum(p.pause.paused_s(end) for p in ports),
        "retransmits": sum(f.retransmits for f in flows),
        "timeouts": sum(f.timeouts for f in flows),
        "nacks": sum(f.nacks for f in flows),
        "wrong": count_wrong(list(zip(flows, rxs, strict=True))),
        "peak_queue_bytes": max(p.peak_bytes for p in ports),
        "events": net.events,
        "wall_s": wall,
        "settings": {**dataclasses.asdict(s), "uplink_gbps": s.uplink_gbps,
                     "base_rtt_us": s.base_rtt_s * 1e6},
    }
