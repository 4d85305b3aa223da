"""What every part of a switch shares: who it is, its ports and routes, its
place in the aggregation tree, its counters, and the way out for frames.

The forwarding core (:mod:`switchd.core.switch`) owns one
:class:`SwitchContext`; each in-network service (:mod:`switchd.core.service`)
gets it at construction and sends through it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Final

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import NackCode, Op
from fabric.core.topology import Topology

__all__ = ["INCARNATION_BITS", "Counters", "Output", "SwitchContext", "next_hops"]

#: Bits of a group's incarnation id: drawn at random by the tree root when the
#: group is created, so a peer outside the group cannot guess it (and a group
#: made again with the same members gets another one).
INCARNATION_BITS: Final = 63

#: What a switch returns from ``handle``: frames to send, by port.
Output = tuple[bytes, Any, Any]


@dataclass
class Counters:
    """The switch's counters, shared by the core and its services."""

    frames_in: int = 0
    bytes_in: int = 0
    forwarded: int = 0
    reduce_frames: int = 0
    results_sent: int = 0
    missing_asked: int = 0  # MISSING NACKs: a member asked for one lost contribution
    ctrl_frames: int = 0
    malformed: int = 0
    unauthorised: int = 0
    nacks_sent: int = 0
    nacks_received: int = 0
    unroutable: int = 0
    # semantic distance of what the switch does to payloads: one per
    # contribution copied or reduced into slot memory (frame plane), one per
    # result stored into a member's region (memory plane)
    payload_copies: int = 0
    mem_stores: int = 0
    mcast_frames: int = 0  # Flag.MCAST frames in, and the copies sent for them
    mcast_copies: int = 0
    jobs_refused: int = 0
    trimmed_forwarded: int = 0  # trimmed frames (a switch cut their payload) passed on
    nack_codes: dict[str, int] = field(default_factory=dict)


class SwitchContext:
    """One switch of ``topo`` as its services see it (read the attributes; send
    with :meth:`send`, :meth:`nack` and :meth:`ctrl`).

    NACKs and control answers always carry a CRC32C. Data frames a switch
    originates (results, partial sums, combine sums) carry it whenever the
    fabric checks (``crc``): the driver says its links may corrupt, or a frame
    with a CRC has reached this switch (from then on). Frames it forwards pass
    unchanged.
    """

    def __init__(self, topo: Topology, name: str, rng: random.Random | None = None,
                 crc: bool = False) -> None:
        self.topo = topo
        self.name = name
        #: CRC on the data frames this switch originates (see the class doc)
        self.crc = crc
        # incarnation ids: the daemon passes random.SystemRandom(); the simulator
        # a seeded generator, so its runs repeat
        self._rng = rng if rng is not None else random.Random(f"{topo.name}/{name}")
        self.node = topo.node(name)
        self.id: int = self.node.id
        self.counters = Counters()
        attached = set(topo.attached(name))
        #: port of each attached node and neighbour switch, by node id
        self.ident: dict[int, bytes] = {}
        #: the node id each node port speaks for (the port is the sender's identity)
        self.port_node: dict[bytes, int] = {}
        for n in topo.nodes:
            if n.name in attached:
                self.ident[n.id] = n.name.encode()
                if not n.is_switch:
                    self.port_node[n.name.encode()] = n.id
        self.attached_ids: set[int] = set(self.port_node.values())
        self.worker_ids: frozenset[int] = frozenset(w.id for w in topo.workers)
        self.switch_ports: set[bytes] = set()
        for link in topo.links_of(name):
            other = topo.node(link.other(name))
            if other.is_switch:
                self.switch_ports.add(other.name.encode())
                self.ident[other.id] = other.name.encode()
        #: node id -> the port a frame for it leaves on
        self.next_hop: dict[int, bytes] = next_hops(topo, name, attached)
        # aggregation tree: workers below this switch and below each child switch
        tree = topo.aggregation_tree()
        self.in_tree = name in tree
        self.parent_name: str | None = tree.get(name)
        self.below: set[int] = set()
        self.child_below: dict[int, set[int]] = {}
        if self.in_tree:
            self.below = {topo.node(w).id for w in topo.subtree_workers(name)}
            for c in topo.tree_children(name):
                self.child_below[topo.node(c).id] = {
                    topo.node(w).id for w in topo.subtree_workers(c)}
        #: (src, request id) of the control request being handled: an answer to
        #: that node carries the id, so a late answer to an earlier request is
        #: never taken for the answer to a later one
        self.asking: tuple[int, int] = (-1, 0)
        self.out: list[Output] = []

    def incarnation(self) -> int:
        """A fresh, unpredictable incarnation id (never 0: 0 is the world group)."""
        return self._rng.getrandbits(INCARNATION_BITS) or 1

    def parent_id(self) -> int:
        """Node id of this switch's parent in the aggregation tree (it has one)."""
        assert self.parent_name is not None
        return self.topo.node(self.parent_name).id

    def same_host(self, node_id: int) -> bool:
        """True when node ``node_id`` runs on this switch's host (the topology's
        placement): only then is its shared memory mappable here."""
        topo = self.topo
        return topo.host_address(topo.by_id(node_id).name) == topo.host_address(self.name)

    def send(self, port: bytes, header: Any, payload: Any = None) -> None:
        """Queue a frame out of ``port``."""
        self.out.append((port, header, payload))

    def nack(self, port: bytes, f_src: int, job: int, psn: int, msg: int, code: NackCode,
             why: str) -> None:
        """Refuse a frame of ``f_src`` with ``code`` (counted)."""
        self.count_nack(code.name)
        self.send(port, fr.encode_nack(src=self.id, dst=f_src, flow=0, psn=psn, code=code,
                                       job=job, msg=msg, crc=True))

    def count_nack(self, code: str) -> None:
        """Count one NACK sent, by code."""
        c = self.counters
        c.nacks_sent += 1
        c.nack_codes[code] = c.nack_codes.get(code, 0) + 1

    def ctrl(self, port: bytes, dst: int, t: str, **fields: Any) -> None:
        """Send control message ``t`` to node ``dst`` over ``port``."""
        asker, rid = self.asking
        self.send(port, fr.encode(Op.CTRL, src=self.id, dst=dst, crc=True,
                                  msg=rid if asker == dst else 0,
                                  payload=control.pack(t, **fields)))


def next_hops(topo: Topology, name: str, attached: set[str]) -> dict[int, bytes]:
    """Node id -> the port a frame for it leaves on (fewest hops, lowest id on ties)."""
    hops: dict[int, bytes] = {}
    for n in topo.nodes:
        if n.name == name:
            continue
        if n.name in attached:
            hops[n.id] = n.name.encode()
        else:
            path = topo.route(name, n.name)
            if len(path) > 1:
                hops[n.id] = path[1].encode()
    return hops
