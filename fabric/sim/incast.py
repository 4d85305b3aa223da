"""The incast scenario: N senders, one receiver, one switch, in virtual time.

Every sender starts at t = 0 and sends ``size`` bytes to the receiver through
one switch whose port to the receiver is the bottleneck (:mod:`fabric.sim.network`,
:mod:`fabric.sim.transport`). Link latencies are set so that an MTU frame and
its ACK take ``base_rtt_s`` on an idle fabric. Defaults follow htsim: 100 Gb/s,
MTU 4150 B, 12 us base RTT, a buffer of 1 BDP with trimming (5 BDP without),
ECN from 0.2 to 0.8 BDP. With PFC the buffer defaults to HPCC's 32 MB (or twice
the headroom, if more), every port keeps a headroom of 3 x rate x link delay,
and an ingress pauses its sender above 1/8 of the free buffer outside the
headroom (HPCC's ns-3).

The figures (:func:`run_incast`, plain data, all virtual time but ``wall_s``):

* ``completion_s``: when the receiver has the last byte of every flow;
* ``ideal_s``: every flow's frames back to back at the bottleneck's rate, plus
  the first frame's way to the receiver (its serialisation once more, at the
  switch, and two links' latency);
* ``fct_slowdown``: each flow's completion time over its time alone on the
  fabric (its frames at line rate plus that first frame's way), p50/p95/p99;
* ``goodput_gbps``: payload bytes over ``completion_s``; ``jain``: Jain's index
  of the flows' throughputs (size / FCT), ``jain_first_done`` of the bytes each
  had delivered when the first flow finished, ``jain_steady`` of what each
  delivered in the second half of the time before that (the converged shares);
* ``drops``, ``trims``, ``ecn_marks``, ``pauses``, ``paused_s``, ``retransmits``,
  ``timeouts``; the bottleneck's ``peak_queue_bytes`` and ``mean_queue_bytes``;
* ``wrong``: bytes the receiver holds that differ from what was sent, plus
  bytes it never received (0 when exact).
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
    PfcIngress,
    RedMarker,
    SharedBuffer,
    dcqcn,
    get_cc,
    make_cc,
)
from fabric.core.congestion.config import (
    HPCC_BUFFER_BYTES,
    HPCC_HEADROOM_LINK_DELAYS,
    HPCC_PFC_ALPHA,
    HTSIM_BASE_RTT_S,
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
from fabric.core.congestion.credit import CreditLink, link_credit_bytes
from fabric.core.congestion.dcqcn import CnpPacer
from fabric.core.congestion.eqds import CreditPacer
from fabric.sim.figures import count_wrong, jain, slowdowns, steady_jain
from fabric.sim.network import CONTROL_WIRE_BYTES, Net, Switch
from fabric.sim.transport import Host, ReceiverFlow, SenderFlow

__all__ = ["IncastSettings", "run_incast"]

#: The retransmission timer: at least this many base RTTs, and at least a base
#: RTT plus twice the time to drain a full buffer (a frame may wait that long).
RTO_MIN_RTTS = 4.0
#: A run that has not finished after this many ideal times is stopped and
#: reported as not finished (a stall, or a PFC deadlock).
STALL_IDEALS = 200.0
#: With trimming, room for this many trimmed headers comes on top of the data
#: buffer, for them alone (htsim gives headers a queue of their own). They leave
#: first, at 64 B each, but every sender's burst may arrive within one frame time.
TRIM_RESERVE_HEADERS = 1024
#: Flows' progress is sampled every this many base RTTs (for ``jain_steady``).
SAMPLE_RTTS = 8
#: The most senders one run takes (a typo guard: each is a host and a flow).
MAX_SENDERS = 65535


@dataclass(frozen=True)
class IncastSettings:
    """Everything one incast run depends on (reported with its results)."""

    senders: int
    size: int  # bytes per sender
    link_gbps: float = HTSIM_LINK_GBPS
    mtu: int = HTSIM_MTU
    base_rtt_us: float = HTSIM_BASE_RTT_S * 1e6
    cc: str = "nscc"
    buffer: int | None = None  # bytes for the switch; None: the default above
    buffer_alpha: float = math.inf  # dynamic threshold (inf: the pool's size only)
    trim: bool = False
    pfc: bool = False
    credit: bool = False  # credit-based flow control on every link (lossless)
    kmin: int | None = None  # ECN thresholds (bytes); None: the policy's profile
    kmax: int | None = None
    pmax: float | None = None
    ecn: bool = True
    seed: int = 0

    @property
    def base_rtt_s(self) -> float:
        return self.base_rtt_us / 1e6

    @property
    def bdp(self) -> int:
        return bdp_bytes(self.link_gbps, self.base_rtt_s)

    def resolved(self) -> IncastSettings:
        """The settings with every default filled in and checked; a
        :class:`CongestionConfigError` (one line) for an impossible one."""
        if not 1 <= self.senders <= MAX_SENDERS:
            raise CongestionConfigError(f"--senders {self.senders}: must be 1..{MAX_SENDERS}")
        check_bytes("--size", self.size, minimum=1)
        if not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
            raise CongestionConfigError(f"--link-gbps {self.link_gbps}: must be a positive "
                                        "number")
        check_bytes("--mtu", self.mtu, minimum=fr.HEADER_SIZE + 1, maximum=1 << 24)
        if not (math.isfinite(self.base_rtt_us) and self.base_rtt_us > 0):
            raise CongestionConfigError(f"--base-rtt-us {self.base_rtt_us}: must be positive")
        get_cc(self.cc)
        bdp = self.bdp
        buffer = self.buffer
        reserve = self.pfc_reserve
        if self.credit and (self.pfc or self.trim):
            raise CongestionConfigError("--credit and --pfc/--trim: credit-based links are "
                                        "lossless by themselves; choose one")
        if buffer is None:
            buffer = max(HPCC_BUFFER_BYTES, 2 * reserve) if self.pfc else int(
                (HTSIM_QUEUE_BDP_TRIM if self.trim else HTSIM_QUEUE_BDP_DROP) * bdp)
            if self.credit:  # every link's credits are room in the buffer
                buffer = max(buffer, self.credit_reserve)
        check_bytes("--buffer", buffer)
        if buffer < self.mtu:
            raise CongestionConfigError(f"--buffer {buffer} B holds no frame of one MTU "
                                        f"({self.mtu} B); give at least that")
        if self.credit and buffer < self.credit_reserve:
            raise CongestionConfigError(
                f"--buffer {buffer} B is below the credits the switch grants its "
                f"{self.senders + 1} links ({self.credit_reserve} B, "
                f"{self.link_credits} B each: a round trip of each link at its rate); raise "
                f"it to at least {self.credit_reserve} or drop --credit")
        if self.pfc and buffer < reserve + self.mtu:
            raise CongestionConfigError(
                f"--buffer {buffer} B cannot keep PFC headroom for {self.senders + 1} ports "
                f"({reserve} B) and a frame more; raise it to at least {reserve + self.mtu}")
        if self.pfc and self.trim:
            raise CongestionConfigError("--pfc and --trim: a lossless class is never trimmed; "
                                        "choose one")
        if self.cc == "dcqcn":  # the RED profile DCQCN was tuned with, within the buffer
            kmin0, kmax0, pmax0 = (min(dcqcn.ECN_KMIN, buffer), min(dcqcn.ECN_KMAX, buffer),
                                   dcqcn.ECN_PMAX)
        else:  # htsim's: 0.2 to 0.8 BDP, every frame above
            kmin0, kmax0, pmax0 = (int(HTSIM_ECN_KMIN_BDP * bdp), int(HTSIM_ECN_KMAX_BDP * bdp),
                                   1.0)
        kmin = kmin0 if self.kmin is None else self.kmin
        kmax = kmax0 if self.kmax is None else self.kmax
        pmax = pmax0 if self.pmax is None else self.pmax
        RedMarker(kmin, kmax, pmax, random.Random(0))  # checks Kmin <= Kmax, Pmax
        if not self.buffer_alpha > 0:
            raise CongestionConfigError(f"--buffer-alpha {self.buffer_alpha}: must be positive")
        if self.headroom < self.mtu and self.pfc:
            raise CongestionConfigError(
                f"PFC headroom {self.headroom} B is below one MTU ({self.mtu} B): raise "
                "--base-rtt-us (longer links) or lower --mtu")
        return dataclasses.replace(self, buffer=buffer, kmin=kmin, kmax=kmax, pmax=pmax)

    @property
    def link_latency_s(self) -> float:
        """One link's latency: an MTU frame and a control frame each cross two links
        each way (sender, switch, receiver) in one base RTT."""
        rate = self.link_gbps * 1e9
        wire = 2 * (self.mtu + CONTROL_WIRE_BYTES) * 8 / rate
        return max(self.base_rtt_s - wire, 0.0) / 4

    @property
    def link_credits(self) -> int:
        """Credits each link grants its sender: one round trip of the link at its
        rate, plus an MTU (:func:`~fabric.core.congestion.credit.link_credit_bytes`)."""
        return link_credit_bytes(self.link_gbps, self.link_latency_s, self.mtu,
                                 CONTROL_WIRE_BYTES)

    @property
    def credit_reserve(self) -> int:
        """The switch's buffer its links' credits stand for."""
        return (self.senders + 1) * self.link_credits if self.credit else 0

    @property
    def pfc_reserve(self) -> int:
        """Buffer bytes PFC keeps as headroom: one per switch port."""
        return (self.senders + 1) * self.headroom if self.pfc else 0

    @property
    def headroom(self) -> int:
        """PFC headroom per port: HPCC's 3 x rate x link delay (links too short for
        it to hold one MTU are refused)."""
        return int(HPCC_HEADROOM_LINK_DELAYS * self.link_gbps * 1e9 / 8 * self.link_latency_s)


def _kick(port: Any, t: float) -> None:
    port.kick(t)


def run_incast(settings: IncastSettings,
               record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Simulate one incast; the figures of the module docstring plus every setting.

    ``record`` (a dict) is filled with time series for plots and traces:
    ``queues`` (the bottleneck port's data queue, ``[(t, bytes)]`` at every change)
    and ``pauses`` (per port ever paused, ``[(t, paused)]``)."""
    s = settings.resolved()
    assert s.buffer is not None and s.kmin is not None and s.kmax is not None
    assert s.pmax is not None
    wall0 = time.perf_counter()
    rate = s.link_gbps * 1e9
    lat = s.link_latency_s
    net = Net()
    rng = random.Random(s.seed)
    reserve = TRIM_RESERVE_HEADERS * TRIM_HEADER_BYTES if s.trim else 0
    buf = SharedBuffer(s.buffer + reserve, alpha=s.buffer_alpha,
                       trim_bytes=TRIM_HEADER_BYTES if s.trim else 0,
                       trim_reserve_bytes=reserve)
    marker = RedMarker(s.kmin, s.kmax, s.pmax, random.Random(s.seed + 1)) if s.ecn else None
    pfc = PfcIngress(mtu=s.mtu, headroom_bytes=s.headroom, alpha=HPCC_PFC_ALPHA,
                     resume_offset_bytes=s.mtu) if s.pfc else None
    sw = Switch(net, "sw0", buf, marker=marker, pfc=pfc, trim=s.trim, rng=rng)
    sw.pfc_reserve = s.pfc_reserve
    sw.credit = s.credit
    path = CcPath(link_gbps=s.link_gbps, base_rtt_s=s.base_rtt_s, mtu=s.mtu, trimming=s.trim)
    policy = get_cc(s.cc)
    rto = max(RTO_MIN_RTTS * s.base_rtt_s, s.base_rtt_s + 2 * s.buffer * 8 / rate)
    hosts = [Host(net, f"h{i}", i) for i in range(s.senders + 1)]
    receiver = hosts[-1]
    for h in hosts:
        nic = h.attach(rate, lat)
        port = sw.add_port(rate, lat)
        nic.connect(sw, port.index)
        port.connect(h, 0)
        sw.routes[h.hid] = [port.index]
        if s.credit:  # each end holds the other's input buffer as credits
            nic.credit = CreditLink(s.link_credits, mtu=s.mtu)
            port.credit = CreditLink(s.link_credits, mtu=s.mtu)
            h.returns_credit = True
    hot = sw.ports[receiver.hid]
    if record is not None:
        hot.depth = []
        for h in hosts:
            h.nic.pause_log = []
    if policy.wants_cnp:
        receiver.cnp = CnpPacer()
    if policy.receiver_driven:
        receiver.credit = CreditPacer(s.link_gbps, s.mtu)
    flows: list[SenderFlow] = []
    for i in range(s.senders):
        data = np.frombuffer(np.random.default_rng((s.seed, i)).bytes(s.size), np.uint8)
        cc = make_cc(s.cc, path)
        f = SenderFlow(i, hosts[i], receiver.hid, data, s.mtu, cc, rto)
        hosts[i].add_sender(f)
        flows.append(f)
        receiver.receivers[i] = ReceiverFlow(i, i, s.size, s.mtu)
    net.pending = s.senders
    if policy.receiver_driven:
        receiver.unsolicited_bytes = int(flows[0].cc.credit)
    wire_total = sum(f.wire_bytes for f in flows)
    # a first frame crosses the sender's link and a link more (store and forward)
    first_hop = 2 * lat + flows[0].wire_size(0) * 8 / rate
    ideal = wire_total * 8 / rate + first_hop
    for h in hosts[:-1]:
        net.at(0.0, _kick, h.nic)
    rx_list = [receiver.receivers[i] for i in range(s.senders)]
    first_done: list[int] = []
    samples: list[tuple[float, list[int]]] = []  # (t, frames each flow has delivered)
    period = SAMPLE_RTTS * s.base_rtt_s

    def sample(_a: Any, t: float) -> None:
        samples.append((t, [rx.count for rx in rx_list]))
        if net.pending == s.senders:  # until the first flow is done
            net.at(t + period, sample)

    net.at(0.0, sample)

    def finished() -> bool:
        if not first_done and net.pending < s.senders:
            first_done.extend(rx.count for rx in rx_list)
        return net.pending == 0

    done = net.run(finished, STALL_IDEALS * ideal + 1.0)
    wall = time.perf_counter() - wall0
    rxs = [receiver.receivers[i] for i in range(s.senders)]
    end = max((rx.done_at or net.now) for rx in rxs)
    wrong = count_wrong(list(zip(flows, rxs, strict=True)))
    fcts = [(rx.done_at if rx.done_at is not None else end) for rx in rxs]
    alone = [f.wire_bytes * 8 / rate + first_hop for f in flows]
    ports = [h.nic for h in hosts] + sw.ports
    settings_out = dataclasses.asdict(s)
    if record is not None:
        record["queues"] = {hot.name: hot.depth}
        record["pauses"] = {p.name: p.pause_log for p in ports if p.pause_log}
    return {
        "scenario": "incast",
        "finished": done,
        "completion_s": end,
        "ideal_s": ideal,
        "of_ideal": end / ideal,
        "fct_slowdown": slowdowns(fcts, alone),
        "goodput_gbps": s.senders * s.size * 8 / end / 1e9 if end > 0 else 0.0,
        "jain": jain([f.size / fct for f, fct in zip(flows, fcts, strict=True)]),
        "jain_first_done": jain([float(c) for c in first_done]) if first_done else 1.0,
        "jain_steady": steady_jain(samples),
        "drops": buf.drops,
        "trims": buf.trims,
        "ecn_marks": sw.ecn_marks,
        "pauses": sum(p.pause.pauses for p in ports),
        "paused_s": sum(p.pause.paused_s(end) for p in ports),
        "credit_stalls": sum(p.credit.stalls for p in ports if p.credit is not None),
        "credit_stalled_s": sum(p.credit.stalled(end) for p in ports if p.credit is not None),
        "retransmits": sum(f.retransmits for f in flows),
        "timeouts": sum(f.timeouts for f in flows),
        "nacks": sum(f.nacks for f in flows),
        "wrong": wrong,
        "peak_queue_bytes": hot.peak_bytes,
        "mean_queue_bytes": hot.mean_queue(end),
        "buffer_peak_bytes": buf.peak,
        "lossless_drops": sw.lossless_drops,
        "events": net.events,
        "wall_s": wall,
        "settings": settings_out,
    }
