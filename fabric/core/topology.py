"""Topology model: which nodes exist, how they are linked, and what the links cost.

A topology is a TOML file (format in ``docs/TOPOLOGY.md``) with ``[[node]]``
tables (workers, hosts, switches), ``[[link]]`` tables (one per cable, with a
network class and link parameters), per-class ``[defaults.<class>]`` and an
optional ``[fabric]`` table (name, transport, ports, addresses for multi-host
runs). :func:`load` / :func:`loads` validate it and return a :class:`Topology`;
every problem raises :class:`TopologyError` with one line that names the file,
the item and the fix.

The :class:`Topology` answers the questions the rest of semfab asks: node ids
(u16, used in frame headers), ranks, which switch a worker hangs off, the
switches a frame crosses, the aggregation tree for in-network reduction, the
oversubscription of each leaf, and the ZeroMQ address of each node.

This module is pure: no sockets, no event loop, no clock. The only I/O is
:func:`load` reading a file and the CLI helpers printing text.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
import tomllib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, cast

from fabric.core.congestion.config import CongestionConfigError
from fabric.core.congestion.settings import CONGESTION_KEYS, CongestionSettings

__all__ = [
    "BUILTIN_DEFAULTS",
    "CLUSTER_DEFAULTS",
    "DEFAULT_BASE_PORT",
    "DEFAULT_TENANT",
    "TenantQuota",
    "LINK_CLASSES",
    "LINK_PARAM_KEYS",
    "MAX_MTU",
    "MAX_NODES",
    "MIN_MTU",
    "NODE_KINDS",
    "TRANSPORTS",
    "Link",
    "LinkClass",
    "LinkParams",
    "Node",
    "NodeKind",
    "Topology",
    "TopologyError",
    "check_main",
    "gen_main",
    "cluster",
    "leaf_spine",
    "load",
    "loads",
    "star",
]

NodeKind = Literal["worker", "host", "switch"]
LinkClass = Literal["scaleup", "scaleout", "frontend"]

#: Node kinds, in node-id order (workers first, so a worker's id is its rank).
NODE_KINDS: tuple[NodeKind, ...] = ("worker", "host", "switch")
#: The three networks of DESIGN.md 1.6.
LINK_CLASSES: tuple[LinkClass, ...] = ("scaleup", "scaleout", "frontend")
#: Link parameters a ``[[link]]`` or ``[defaults.<class>]`` table may set.
LINK_PARAM_KEYS: tuple[str, ...] = ("latency_us", "bandwidth_gbps", "loss", "mtu", "llr",
                                     "credit")
TRANSPORTS: tuple[str, ...] = ("ipc", "tcp")

MIN_MTU = 256
MAX_MTU = 16 * 1024 * 1024
#: Node ids are u16; 0xFFFF is kept free so drivers can use it as "no node".
MAX_NODES = 0xFFFF
#: First tcp port; node ``id`` listens on ``base_port + id``. Below the Linux
#: ephemeral range (32768+) so outgoing connections never take our ports.
DEFAULT_BASE_PORT = 24000
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_NAME = "semfab"

_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
# Bounds on what a file may ask for: beyond them a value is a typo that would
# only fail later (a socket path over the Unix limit, a shaper that never
# sends, a delay that outlasts every timeout).
_MAX_NAME = 64  # keeps <sock dir>/<name>.sock under the 107-byte ipc limit
_MAX_FABRIC_NAME = 64
_MAX_HOSTNAME = 253  # RFC 1035
_MIN_BANDWIDTH_GBPS = 1e-6  # 1 kbit/s
_MAX_BANDWIDTH_GBPS = 1e6  # 1 Pbit/s
_MAX_LATENCY_US = 1e7  # 10 s
_TOP_KEYS = ("fabric", "defaults", "node", "link", "tenants", "congestion")
#: Keys of one ``[tenants.<name>]`` quota table (each optional: absent = no limit).
_TENANT_KEYS = ("slots", "memory_bytes", "groups", "regions")
#: The tenant of a worker that names none.
DEFAULT_TENANT = "default"
_FABRIC_KEYS = ("name", "transport", "base_port", "host_addresses")
_NODE_KEYS = ("name", "kind")
_NODE_OPTIONAL = ("tenant",)
_LINK_KEYS = ("a", "b", "class", *LINK_PARAM_KEYS)
_SUMMARY_CHILDREN = 8
# Linux sun_path is 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107


class TopologyError(ValueError):
    """A topology is invalid or a query names something it does not have.

    ``str(err)`` is one line: ``<source>: <item>: <problem>; <fix>``.
    """


def _fail(source: str, item: str, problem: str) -> TopologyError:
    return TopologyError(f"{source}: {item}: {problem}" if item else f"{source}: {problem}")


# ---------------------------------------------------------------------------
# value objects
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's share of every switch: at most ``slots`` aggregation slots,
    ``memory_bytes`` of slot memory, ``groups`` communicators (multicast groups)
    and ``regions`` memory-plane regions at once (None: no limit; for groups, an
    even share of the ids when the fabric has several tenants)."""

    slots: int | None = None
    memory_bytes: int | None = None
    groups: int | None = None
    regions: int | None = None


@dataclass(frozen=True)
class Node:
    """A node of the fabric. ``id`` is the u16 used in frame headers."""

    name: str
    kind: NodeKind
    id: int
    #: Who the node works for (workers): a job's members share one tenant, whose
    #: quota of switch slots and memory it counts against ("" = DEFAULT_TENANT).
    tenant: str = ""

    @property
    def is_switch(self) -> bool:
        return self.kind == "switch"

    @property
    def is_endpoint(self) -> bool:
        """Workers and hosts are endpoints: they attach to exactly one switch."""
        return self.kind != "switch"


def _param_problem(key: str, value: object) -> str | None:
    """Return why ``value`` is not valid for link parameter ``key``, or None."""
    if key in ("llr", "credit"):
        if not isinstance(value, bool):
            what = "link-level retry" if key == "llr" else "credit-based flow control"
            return f"{key} must be true or false ({what}), got {value!r}"
        return None
    if key == "mtu":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"mtu must be an integer number of bytes, got {value!r}"
        if not MIN_MTU <= value <= MAX_MTU:
            return f"mtu must be in {MIN_MTU}..{MAX_MTU} bytes (16 MiB), got {value}"
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{key} must be a number, got {value!r}"
    if isinstance(value, int) and abs(value) > 2**63:
        # TOML integers have no size limit in tomllib; float() would overflow
        return f"{key} must be finite, got an integer of {len(str(abs(value)))} digits"
    if not math.isfinite(value):
        return f"{key} must be finite, got {value!r}"
    if key == "loss":
        if not 0.0 <= value < 1.0:
            return f"loss must be a probability with 0 <= loss < 1, got {value!r}"
    elif value < 0:
        unit = "microseconds" if key == "latency_us" else "Gbit/s; 0 means unshaped"
        return f"{key} must be >= 0 ({unit}), got {value!r}"
    elif key == "latency_us" and value > _MAX_LATENCY_US:
        return (f"latency_us must be in 0..{_MAX_LATENCY_US:.0f} microseconds (at most 10 s), "
                f"got {value!r}")
    elif key == "bandwidth_gbps" and value and not (
        _MIN_BANDWIDTH_GBPS <= value <= _MAX_BANDWIDTH_GBPS
    ):
        return (f"bandwidth_gbps must be 0 (unshaped) or between {_MIN_BANDWIDTH_GBPS:g} and "
                f"{_MAX_BANDWIDTH_GBPS:g} Gbit/s, got {value!r}")
    return None


@dataclass(frozen=True)
class LinkParams:
    """Emulated properties of one link (the same in both directions).

    ``bandwidth_gbps == 0`` means unshaped: bytes move as fast as the host can
    move them, which is what a default emulation measures.
    """

    latency_us: float = 0.0
    bandwidth_gbps: float = 0.0
    loss: float = 0.0
    mtu: int = 256 * 1024
    #: Link-level retry: the link replays a frame its far end received damaged or
    #: not at all, so it delivers every frame once and in order, later
    #: (fabric.core.link; UALink's and NVLink's links do this).
    llr: bool = False
    #: Credit-based flow control: the link sends a frame only into buffer its far
    #: end granted, and waits for the credit back once it is full, so it never
    #: overflows (fabric.core.congestion.credit; UALink's and NVLink's links do this).
    credit: bool = False

    def __post_init__(self) -> None:
        for key in LINK_PARAM_KEYS:
            problem = _param_problem(key, getattr(self, key))
            if problem:
                raise TopologyError(f"LinkParams: {problem}")
        # Normalise ints to floats so equal values compare and print equal.
        for key in ("latency_us", "bandwidth_gbps", "loss"):
            object.__setattr__(self, key, float(getattr(self, key)))

    @property
    def shaped(self) -> bool:
        """True when the link has a bandwidth limit."""
        return self.bandwidth_gbps > 0

    def serialization_us(self, nbytes: int) -> float:
        """Time to put ``nbytes`` on the wire at the link bandwidth (0 if unshaped)."""
        if not self.shaped:
            return 0.0
        # 1 Gbit/s is 1000 bits per microsecond.
        return nbytes * 8 / (self.bandwidth_gbps * 1000.0)

    def replace(self, **changes: Any) -> LinkParams:
        """Return a copy with some fields changed (validated)."""
        values = {k: getattr(self, k) for k in LINK_PARAM_KEYS}
        values.update(changes)
        return LinkParams(**values)


#: Built-in class defaults: unshaped, lossless, zero added latency, so a
#: default emulation measures the host. Reference figures for real hardware are
#: in docs/TOPOLOGY.md; they are not defaults.
BUILTIN_DEFAULTS: Mapping[str, LinkParams] = MappingProxyType(
    {
        "scaleup": LinkParams(mtu=256 * 1024),
        "scaleout": LinkParams(mtu=256 * 1024),
        "frontend": LinkParams(mtu=64 * 1024),
    }
)


@dataclass(frozen=True)
class Link:
    """A bidirectional link between nodes ``a`` and ``b`` of network class ``cls``."""

    a: str
    b: str
    cls: LinkClass
    params: LinkParams

    @property
    def endpoints(self) -> tuple[str, str]:
        return (self.a, self.b)

    def other(self, name: str) -> str:
        """The node at the far end from ``name``."""
        if name == self.a:
            return self.b
        if name == self.b:
            return self.a
        raise TopologyError(f"link {self.a} -- {self.b}: node {name!r} is not on this link")


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------


class Topology:
    """A validated, immutable fabric description.

    Build one with :func:`load`, :func:`loads`, :meth:`from_dict`, :func:`star`
    or :func:`leaf_spine`; the constructor trusts its arguments. Two topologies
    are equal when they describe the same fabric (the ``source`` is ignored),
    so ``loads(t.to_toml()) == t``.
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        links: Sequence[Link],
        *,
        name: str = DEFAULT_NAME,
        transport: str = "ipc",
        base_port: int = DEFAULT_BASE_PORT,
        host_addresses: Mapping[str, str] | None = None,
        defaults: Mapping[str, LinkParams] | None = None,
        tenants: Mapping[str, TenantQuota] | None = None,
        source: str = "<topology>",
        congestion: CongestionSettings | None = None,
    ) -> None:
        self._nodes = tuple(sorted(nodes, key=lambda n: n.id))
        self._congestion = congestion if congestion is not None else CongestionSettings()
        self._tenants = MappingProxyType(dict(tenants or {}))
        self._links = tuple(links)
        self._name = name
        self._transport = transport
        self._base_port = base_port
        self._host_addresses = MappingProxyType(dict(host_addresses or {}))
        merged = dict(BUILTIN_DEFAULTS)
        merged.update(defaults or {})
        self._defaults = MappingProxyType(merged)
        self._source = source
        self._by_name = {n.name: n for n in self._nodes}
        self._of_kind = {k: tuple(n for n in self._nodes if n.kind == k) for k in NODE_KINDS}
        self._adj: dict[str, list[tuple[str, Link]]] = {n.name: [] for n in self._nodes}
        for link in self._links:
            self._adj[link.a].append((link.b, link))
            self._adj[link.b].append((link.a, link))
        for nbrs in self._adj.values():
            # Deterministic tie-breaks everywhere: lowest node id first.
            nbrs.sort(key=lambda item: self._by_name[item[0]].id)
        self._bfs_cache: dict[str, dict[str, str | None]] = {}
        self._path_cong: dict[tuple[str, str], CongestionSettings] = {}
        self._tree: dict[str, str | None] | None = None
        self._levels: dict[str, int] | None = None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> Topology:
        """Validate a parsed TOML document (as :func:`tomllib.loads` returns it)."""
        return _build(data, source)

    # -- identity -------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (
            self._nodes,
            self._links,
            self._name,
            self._transport,
            self._base_port,
            tuple(sorted(self._host_addresses.items())),
            tuple(sorted(self._defaults.items())),
            tuple(sorted(self._tenants.items())),
            self._congestion,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"Topology(name={self._name!r}, workers={len(self.workers)}, "
            f"hosts={len(self.hosts)}, switches={len(self.switches)}, links={len(self._links)})"
        )

    # -- plain accessors ----------------------------------------------------

    @property
    def tenants(self) -> Mapping[str, TenantQuota]:
        """Quotas by tenant name (tenants without an entry have no limit)."""
        return self._tenants

    def tenant_of(self, node: str | int) -> str:
        """The tenant a node works for (DEFAULT_TENANT unless the file names one)."""
        n = self.by_id(node) if isinstance(node, int) else self.node(node)
        return n.tenant or DEFAULT_TENANT

    @property
    def name(self) -> str:
        return self._name

    @property
    def source(self) -> str:
        """Where the topology came from (file path or ``<star>``); used in errors."""
        return self._source

    @property
    def transport(self) -> str:
        """``"ipc"`` (one host) or ``"tcp"`` (one or many hosts)."""
        return self._transport

    @property
    def base_port(self) -> int:
        return self._base_port

    @property
    def host_addresses(self) -> Mapping[str, str]:
        """Explicit node -> hostname/IP entries (others run on 127.0.0.1)."""
        return self._host_addresses

    @property
    def congestion(self) -> CongestionSettings:
        """The fabric's queue, marking, PFC and congestion-control settings
        (``[congestion]``; docs/CONGESTION.md)."""
        return self._congestion

    def path_congestion(self, src: str, dst: str) -> CongestionSettings:
        """The congestion settings of traffic from node ``src`` to node ``dst``: its
        route's outermost network class's (``[congestion.<class>]`` over the fabric's
        ``[congestion]``; the fabric's where no class has its own)."""
        cong = self._congestion
        if not cong.classes:
            return cong
        key = (src, dst)
        got = self._path_cong.get(key)
        if got is None:
            classes: list[str] = [lk.cls for lk in self.path_links(src, dst)]
            got = self._path_cong[key] = cong.for_classes(classes)
        return got

    def link_congestion(self, link: Link) -> CongestionSettings:
        """The congestion settings of ``link``'s class (its ports' queues, its credit)."""
        return self._congestion.for_class(link.cls)

    def with_congestion(self, congestion: CongestionSettings) -> Topology:
        """The same fabric with other ``[congestion]`` settings."""
        return Topology(self._nodes, self._links, name=self._name, transport=self._transport,
                        base_port=self._base_port, host_addresses=self._host_addresses,
                        defaults=self._defaults, tenants=self._tenants, source=self._source,
                        congestion=congestion)

    @property
    def defaults(self) -> Mapping[str, LinkParams]:
        """The class defaults in effect (built-ins overridden by the file)."""
        return self._defaults

    @property
    def nodes(self) -> tuple[Node, ...]:
        """All nodes in id order: workers (by rank), hosts, switches."""
        return self._nodes

    @property
    def links(self) -> tuple[Link, ...]:
        """All links in file order."""
        return self._links

    @property
    def workers(self) -> list[Node]:
        """Workers in rank order (rank == id)."""
        return list(self._of_kind["worker"])

    @property
    def hosts(self) -> list[Node]:
        return list(self._of_kind["host"])

    @property
    def switches(self) -> list[Node]:
        return list(self._of_kind["switch"])

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise TopologyError(
                f"{self.source}: node {name!r} is not in the topology; "
                f"nodes: {_short_list(self._by_name)}"
            ) from None

    def by_id(self, node_id: int) -> Node:
        """The node with u16 id ``node_id``."""
        # Ids are dense 0..N-1 and nodes are sorted by id.
        if isinstance(node_id, int) and 0 <= node_id < len(self._nodes):
            return self._nodes[node_id]
        raise TopologyError(
            f"{self.source}: no node has id {node_id!r}; ids are 0..{len(self._nodes) - 1}"
        )

    def rank(self, name: str) -> int:
        """The rank of worker ``name`` (equal to its node id)."""
        node = self.node(name)
        if node.kind != "worker":
            raise TopologyError(
                f"{self.source}: node {name!r} is a {node.kind}; only workers have a rank"
            )
        return node.id

    def host_address(self, name: str) -> str:
        """Hostname or IP the node runs on (``127.0.0.1`` unless set in the file)."""
        self.node(name)
        return self._host_addresses.get(name, DEFAULT_ADDRESS)

    # -- graph queries --------------------------------------------------------

    def links_of(self, name: str) -> list[Link]:
        """Links touching ``name``, far ends in id order."""
        self.node(name)
        return [link for _, link in self._adj[name]]

    def neighbors(self, name: str) -> list[str]:
        """Nodes linked to ``name``, in id order."""
        self.node(name)
        return [other for other, _ in self._adj[name]]

    def _switch(self, name: str) -> Node:
        node = self.node(name)
        if node.kind != "switch":
            raise TopologyError(f"{self.source}: node {name!r} is a {node.kind}, not a switch")
        return node

    def switch_of(self, endpoint_name: str) -> str:
        """The switch a worker or host attaches to (validation guarantees exactly one)."""
        node = self.node(endpoint_name)
        if node.kind == "switch":
            raise TopologyError(
                f"{self.source}: node {endpoint_name!r} is a switch; "
                "switch_of takes a worker or host"
            )
        return self._adj[endpoint_name][0][0]

    def link_between(self, a: str, b: str) -> Link | None:
        """The link joining ``a`` and ``b``, or None when they are not adjacent."""
        self.node(a)
        self.node(b)
        for other, link in self._adj[a]:
            if other == b:
                return link
        return None

    def members_of(self, switch: str) -> list[str]:
        """Workers directly attached to ``switch``, in rank order."""
        self._switch(switch)
        return [o for o, _ in self._adj[switch] if self._by_name[o].kind == "worker"]

    def attached(self, switch: str) -> list[str]:
        """All endpoints (workers, then hosts) directly attached to ``switch``."""
        self._switch(switch)
        return [o for o, _ in self._adj[switch] if self._by_name[o].kind != "switch"]

    def _switch_parents(self, root: str) -> dict[str, str | None]:
        """BFS over the switch graph from ``root``: switch -> parent on a shortest path."""
        cached = self._bfs_cache.get(root)
        if cached is not None:
            return cached
        parents: dict[str, str | None] = {root: None}
        queue = deque([root])
        while queue:
            cur = queue.popleft()
            for other, _ in self._adj[cur]:
                if other not in parents and self._by_name[other].kind == "switch":
                    parents[other] = cur
                    queue.append(other)
        self._bfs_cache[root] = parents
        return parents

    def _distances(self, root: str) -> dict[str, int]:
        parents = self._switch_parents(root)
        dist: dict[str, int] = {}
        for sw in parents:  # BFS order: a parent always comes before its child
            p = parents[sw]
            dist[sw] = 0 if p is None else dist[p] + 1
        return dist

    def route(self, src: str, dst: str) -> list[str]:
        """Switch names a frame from ``src`` to ``dst`` crosses, in order (fewest hops).

        Ties between equal-length paths go to the lowest switch id (no ECMP).
        ``src``/``dst`` may be switches themselves; they are then included.
        """
        s_node, d_node = self.node(src), self.node(dst)
        if src == dst:
            return [src] if s_node.is_switch else []
        s_sw = src if s_node.is_switch else self.switch_of(src)
        d_sw = dst if d_node.is_switch else self.switch_of(dst)
        parents = self._switch_parents(d_sw)
        # Walk from the source towards the destination switch along BFS parents.
        path = [s_sw]
        while path[-1] != d_sw:
            nxt = parents[path[-1]]
            assert nxt is not None  # the switch graph is connected (validated)
            path.append(nxt)
        return path

    def path_links(self, src: str, dst: str) -> list[Link]:
        """The links a frame from ``src`` to ``dst`` traverses, in order."""
        hops = [src, *self.route(src, dst), dst]
        # Drop repeated names when src/dst are switches themselves.
        names = [h for i, h in enumerate(hops) if i == 0 or h != hops[i - 1]]
        out: list[Link] = []
        for a, b in zip(names, names[1:], strict=False):
            link = self.link_between(a, b)
            assert link is not None
            out.append(link)
        return out

    def _root(self) -> str:
        """The switch that minimises the aggregation tree depth.

        Scored by (deepest switch with workers, total worker-weighted distance,
        id): a spine beats a leaf, and among equal spines the first one wins.
        """
        leaves = {s.name: len(self.members_of(s.name)) for s in self.switches}
        leaves = {k: v for k, v in leaves.items() if v}
        best: tuple[int, int, int] | None = None
        root = ""
        for sw in self.switches:
            dist = self._distances(sw.name)
            score = (
                max(dist[leaf] for leaf in leaves),
                sum(dist[leaf] * cnt for leaf, cnt in leaves.items()),
                sw.id,
            )
            if best is None or score < best:
                best, root = score, sw.name
        return root

    def aggregation_tree(self) -> dict[str, str | None]:
        """Switch -> parent switch (None for the root) for in-network aggregation.

        The root minimises the depth (the spine; for a star, the single switch).
        Each switch's parent is its neighbour one hop closer to the root (lowest
        id on ties). Switches with no worker below them (an extra spine, a
        switch that only carries a host) are left out: they only forward.
        """
        if self._tree is None:
            root = self._root()
            parents = self._switch_parents(root)
            keep: set[str] = {root}
            for s in self.switches:
                if self.members_of(s.name):
                    cur: str | None = s.name
                    while cur is not None and cur not in keep:
                        keep.add(cur)
                        cur = parents[cur]
            self._tree = {s: parents[s] for s in parents if s in keep}
        return dict(self._tree)

    def tree_root(self) -> str:
        """The root switch of :meth:`aggregation_tree`."""
        return next(s for s, p in self.aggregation_tree().items() if p is None)

    def tree_children(self, switch: str) -> list[str]:
        """Child switches of ``switch`` in the aggregation tree, in id order."""
        self._switch(switch)
        tree = self.aggregation_tree()
        return [s.name for s in self.switches if tree.get(s.name, "") == switch]

    def subtree_workers(self, switch: str) -> list[str]:
        """Workers whose contribution reaches ``switch`` through the tree (rank order).

        This is the weight a partial sum from ``switch`` represents. Empty for a
        switch outside the tree.
        """
        self._switch(switch)
        tree = self.aggregation_tree()
        out = []
        for w in self.workers:
            cur: str | None = self.switch_of(w.name)
            while cur is not None and cur != switch:
                cur = tree.get(cur)
            if cur == switch:
                out.append(w.name)
        return out

    def _switch_levels(self) -> dict[str, int]:
        """Tier of each switch: hops to the nearest switch with a worker (leaves = 0)."""
        if self._levels is None:
            levels: dict[str, int] = {}
            queue: deque[str] = deque()
            for s in self.switches:
                if self.members_of(s.name):
                    levels[s.name] = 0
                    queue.append(s.name)
            while queue:
                cur = queue.popleft()
                for other, _ in self._adj[cur]:
                    if other not in levels and self._by_name[other].kind == "switch":
                        levels[other] = levels[cur] + 1
                        queue.append(other)
            self._levels = levels
        return self._levels

    def updown_bandwidth(self, switch: str) -> tuple[float, float]:
        """(down, up) total bandwidth of ``switch`` in Gbit/s; ``math.inf`` if unshaped.

        Down-links go to endpoints and to switches of a lower tier; up-links go
        to switches of a higher tier. Tiers count hops from the nearest switch
        that has workers (leaves are tier 0). Links between switches of the
        same tier count on neither side. Any unshaped link makes its side inf.
        """
        self._switch(switch)
        levels = self._switch_levels()
        mine = levels[switch]
        down = up = 0.0
        for other, link in self._adj[switch]:
            bw = link.params.bandwidth_gbps if link.params.shaped else math.inf
            node = self._by_name[other]
            if not node.is_switch or levels[other] < mine:
                down += bw
            elif levels[other] > mine:
                up += bw
        return down, up

    def uplinks(self, switch: str) -> list[Link]:
        """Links from ``switch`` to switches of a higher tier."""
        self._switch(switch)
        levels = self._switch_levels()
        return [
            link
            for other, link in self._adj[switch]
            if self._by_name[other].is_switch and levels[other] > levels[switch]
        ]

    def oversubscription(self, switch: str) -> float:
        """Down-link over up-link bandwidth of ``switch`` (2.0 means 2:1).

        A switch without up-links (a spine, the root of a star) returns 1.0.
        Unshaped links count as infinite bandwidth: unshaped down-links with
        shaped up-links return ``math.inf``; shaped down-links with an unshaped
        up-link return 0.0; unshaped on both sides returns 1.0 (nothing is
        configured to converge; the host sets the pace).
        """
        down, up = self.updown_bandwidth(switch)
        if not self.uplinks(switch):
            return 1.0
        if math.isinf(down) and math.isinf(up):
            return 1.0
        if math.isinf(up):
            return 0.0
        if math.isinf(down):
            return math.inf
        return down / up if up else math.inf

    # -- addresses ------------------------------------------------------------

    def endpoint_address(self, node_name: str, run_dir: str | os.PathLike[str]) -> str:
        """ZeroMQ address peers use to reach ``node_name``.

        ``ipc://<run_dir>/<name>.sock`` for ipc, ``tcp://<host>:<base_port+id>``
        for tcp (host from ``[fabric.host_addresses]``, default 127.0.0.1).
        """
        node = self.node(node_name)
        if self._transport == "ipc":
            path = os.path.join(os.fspath(run_dir), f"{node.name}.sock")
            if len(path.encode()) > _MAX_IPC_PATH:
                raise TopologyError(
                    f"{self.source}: node {node_name!r}: ipc socket path {path!r} is "
                    f"{len(path.encode())} bytes, over the {_MAX_IPC_PATH}-byte Unix limit; "
                    "use a shorter run directory"
                )
            return f"ipc://{path}"
        host = self.host_address(node_name)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return f"tcp://{host}:{self._base_port + node.id}"

    def bind_address(self, node_name: str, run_dir: str | os.PathLike[str]) -> str:
        """ZeroMQ address ``node_name`` binds on.

        Same as :meth:`endpoint_address` for ipc and for loopback hosts; all
        interfaces (``tcp://*:port``) when the node has a network address, so a
        hostname that resolves to another interface still works.
        """
        addr = self.endpoint_address(node_name, run_dir)
        if self._transport == "tcp" and not _is_loopback(self.host_address(node_name)):
            return f"tcp://*:{self._base_port + self.node(node_name).id}"
        return addr

    # -- output ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The topology as a TOML-shaped dict; :meth:`from_dict` reads it back."""
        fabric: dict[str, Any] = {
            "name": self._name,
            "transport": self._transport,
            "base_port": self._base_port,
        }
        if self._host_addresses:
            fabric["host_addresses"] = dict(self._host_addresses)
        defaults = {
            cls: {k: getattr(self._defaults[cls], k) for k in LINK_PARAM_KEYS}
            for cls in LINK_CLASSES
        }
        links = []
        for link in self._links:
            entry: dict[str, Any] = {"a": link.a, "b": link.b, "class": link.cls}
            base = self._defaults[link.cls]
            # Only overrides are written; the rest comes from [defaults.<class>].
            for k in LINK_PARAM_KEYS:
                if getattr(link.params, k) != getattr(base, k):
                    entry[k] = getattr(link.params, k)
            links.append(entry)
        return {
            "fabric": fabric,
            "defaults": defaults,
            "node": [{"name": n.name, "kind": n.kind, **({"tenant": n.tenant} if n.tenant else {})}
                     for n in self._nodes],
            "link": links,
            **({"tenants": {t: {k: v for k, v in (("slots", q.slots),
                                                  ("memory_bytes", q.memory_bytes),
                                                  ("groups", q.groups),
                                                  ("regions", q.regions))
                                if v is not None}
                            for t, q in self._tenants.items()}} if self._tenants else {}),
            **({"congestion": self._congestion.to_table()}
               if not self._congestion.is_default else {}),
        }

    def to_toml(self) -> str:
        """The topology as TOML text; ``loads(t.to_toml()) == t``."""
        d = self.to_dict()
        out = [
            # The name is written escaped: a comment may not hold control characters.
            f"# semfab topology {_toml_value(self._name)}: {_plural(len(self.workers), 'worker')}, "
            f"{_plural(len(self.hosts), 'host')}, "
            f"{_plural(len(self.switches), 'switch', 'switches')}, "
            f"{_plural(len(self._links), 'link')}",
            "# Format: docs/TOPOLOGY.md. Node ids: workers 0..W-1 (= rank), then hosts, "
            "then switches.",
            "",
            "[fabric]",
        ]
        fabric = dict(d["fabric"])
        addrs = fabric.pop("host_addresses", None)
        out += [f"{k} = {_toml_value(v)}" for k, v in fabric.items()]
        if addrs:
            out += ["", "[fabric.host_addresses]"]
            out += [f"{k} = {_toml_value(v)}" for k, v in addrs.items()]
        for cls, params in d["defaults"].items():
            out += ["", f"[defaults.{cls}]"]
            out += [f"{k} = {_toml_value(v)}" for k, v in params.items()]
        for table in ("node", "link"):
            for entry in d[table]:
                out += ["", f"[[{table}]]"]
                out += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
        for tenant, quota in d.get("tenants", {}).items():
            out += ["", f"[tenants.{_toml_value(tenant)}]"]
            out += [f"{k} = {_toml_value(v)}" for k, v in quota.items()]
        if "congestion" in d:
            cong = d["congestion"]
            out += ["", "[congestion]"]
            out += [f"{k} = {_toml_value(v)}" for k, v in cong.items()
                    if not isinstance(v, dict)]
            for cls, keys in cong.items():
                if isinstance(keys, dict):
                    out += ["", f"[congestion.{cls}]"]
                    out += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        return "\n".join(out) + "\n"

    def summary(self) -> str:
        """A short human-readable description (what ``semfab topo check`` prints)."""
        w, h, s = self.workers, self.hosts, self.switches
        lines = [f"fabric: {self._name} (transport {self._transport})"]
        lines.append(
            f"nodes: {len(self._nodes)} = {_plural(len(w), 'worker')} {_id_range(w)}, "
            f"{_plural(len(h), 'host')} {_id_range(h)}, "
            f"{_plural(len(s), 'switch', 'switches')} {_id_range(s)}"
        )
        by_cls = [
            f"{sum(1 for x in self._links if x.cls == c)} {c}"
            for c in LINK_CLASSES
            if any(x.cls == c for x in self._links)
        ]
        lines.append(f"links: {len(self._links)} = {', '.join(by_cls)}")
        tree = self.aggregation_tree()
        lines.append("switch tree (aggregation root first):")

        def walk(sw: str, depth: int) -> None:
            parts = [sw]
            if tree[sw] is None:
                parts.append("[root]")
            members = self.members_of(sw)
            if members:
                parts.append(f"workers: {_short_list(members)}")
            hosts = [x for x in self.attached(sw) if self._by_name[x].kind == "host"]
            if hosts:
                parts.append(f"hosts: {_short_list(hosts)}")
            if self.uplinks(sw):
                down, up = self.updown_bandwidth(sw)
                parts.append(
                    f"oversubscription {_ratio(self.oversubscription(sw))} "
                    f"(down {_gbps(down)} / up {_gbps(up)})"
                )
            lines.append("  " * (depth + 1) + "  ".join(parts))
            children = self.tree_children(sw)
            # Keep big fabrics short: the first few children, a count, the last one.
            if len(children) > _SUMMARY_CHILDREN:
                shown = children[: _SUMMARY_CHILDREN - 1]
                for child in shown:
                    walk(child, depth + 1)
                hidden = len(children) - len(shown) - 1
                lines.append("  " * (depth + 2) + f"... {hidden} more under {sw}")
                walk(children[-1], depth + 1)
            else:
                for child in children:
                    walk(child, depth + 1)

        walk(self.tree_root(), 0)
        rest = [x.name for x in s if x.name not in tree]
        for sw in rest:
            hosts = [x for x in self.attached(sw) if self._by_name[x].kind == "host"]
            extra = f"  hosts: {_short_list(hosts)}" if hosts else ""
            lines.append(f"  {sw}  (not in the tree: forwards only){extra}")
        if not self._congestion.is_default:
            table = self._congestion.to_table()
            lines.append("congestion: " + ", ".join(
                f"{k} {v}" for k, v in table.items() if not isinstance(v, dict)))
            for cls, keys in table.items():
                if isinstance(keys, dict):
                    lines.append(f"  {cls}: " + ", ".join(f"{k} {v}" for k, v in keys.items()))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")


def _check_keys(table: Mapping[str, Any], valid: Sequence[str], source: str, item: str) -> None:
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _fail(source, item, f"unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")


def _table(value: object, source: str, item: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(source, item, f"must be a table ({what}), got {type(value).__name__}")
    return cast(Mapping[str, Any], value)


def _array_of_tables(doc: Mapping[str, Any], key: str, source: str) -> list[Mapping[str, Any]]:
    value = doc.get(key, [])
    if isinstance(value, Mapping) or not isinstance(value, list):
        raise _fail(
            source, f"'{key}'", f"must be an array of tables; write [[{key}]] (two brackets)"
        )
    for i, entry in enumerate(value, 1):
        if not isinstance(entry, Mapping):
            raise _fail(source, f"{key} {i}", f"must be a table, got {entry!r}")
    return cast(list[Mapping[str, Any]], value)


def _params(table: Mapping[str, Any], base: LinkParams, source: str, item: str) -> LinkParams:
    values = {k: getattr(base, k) for k in LINK_PARAM_KEYS}
    for key in LINK_PARAM_KEYS:
        if key in table:
            problem = _param_problem(key, table[key])
            if problem:
                raise _fail(source, item, f"{problem}; fix the value")
            values[key] = table[key]
    return LinkParams(**values)


def _clip(text: str, limit: int = 24) -> str:
    """A long value shortened for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(value: object, source: str, item: str, key: str) -> str:
    if isinstance(value, str) and len(value) > _MAX_NAME:
        raise _fail(
            source,
            item,
            f"{key} {_clip(value)!r} is {len(value)} characters long; node names are at most "
            f"{_MAX_NAME} letters, digits, '_' and '-'",
        )
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise _fail(
            source,
            item,
            f"{key} {value!r} is not a valid node name; use letters, digits, '_' and '-' only",
        )
    return value


def _build(doc: Mapping[str, Any], source: str) -> Topology:
    """Validate a parsed document and build the :class:`Topology`."""
    doc = _table(doc, source, "", "the whole document")
    _check_keys(doc, _TOP_KEYS, source, "top level")

    # [fabric]
    fabric = _table(doc.get("fabric", {}), source, "[fabric]", "write [fabric]")
    _check_keys(fabric, _FABRIC_KEYS, source, "[fabric]")
    fname = fabric.get("name", DEFAULT_NAME)
    if not isinstance(fname, str) or not fname or "\n" in fname:
        raise _fail(source, "[fabric]", f"name must be a non-empty one-line string, got {fname!r}")
    if len(fname) > _MAX_FABRIC_NAME:
        raise _fail(
            source,
            "[fabric]",
            f"name {_clip(fname)!r} is {len(fname)} characters long; "
            f"use at most {_MAX_FABRIC_NAME}",
        )
    transport = fabric.get("transport", "ipc")
    if transport not in TRANSPORTS:
        raise _fail(
            source,
            "[fabric]",
            f"transport {transport!r} is not known; valid transports: {', '.join(TRANSPORTS)}",
        )
    base_port = fabric.get("base_port", DEFAULT_BASE_PORT)
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not 1 <= base_port <= 65535:
        raise _fail(
            source,
            "[fabric]",
            f"base_port must be an integer 1..65535, got {base_port!r}; pick a free port",
        )
    raw_addrs = _table(
        fabric.get("host_addresses", {}),
        source,
        "[fabric.host_addresses]",
        'node name = "hostname or IP"',
    )

    # [defaults.<class>]
    raw_defaults = _table(doc.get("defaults", {}), source, "[defaults]", "write [defaults.<class>]")
    _check_keys(raw_defaults, LINK_CLASSES, source, "[defaults]")
    defaults: dict[str, LinkParams] = {}
    for cls in LINK_CLASSES:
        item = f"[defaults.{cls}]"
        table = _table(raw_defaults.get(cls, {}), source, item, f"write {item}")
        _check_keys(table, LINK_PARAM_KEYS, source, item)
        defaults[cls] = _params(table, BUILTIN_DEFAULTS[cls], source, item)

    # [[node]]
    raw_nodes = _array_of_tables(doc, "node", source)
    declared: dict[str, NodeKind] = {}
    tenant_of: dict[str, str] = {}
    for i, entry in enumerate(raw_nodes, 1):
        item = f"node {i}"
        _check_keys(entry, _NODE_KEYS + _NODE_OPTIONAL, source, item)
        for key in _NODE_KEYS:
            if key not in entry:
                raise _fail(
                    source, item, f"missing key {key!r}; every [[node]] needs name and kind"
                )
        name = _name(entry["name"], source, item, "name")
        item = f"node {name!r}"
        kind = entry["kind"]
        if kind not in NODE_KINDS:
            raise _fail(
                source, item, f"unknown kind {kind!r}; valid kinds: {', '.join(NODE_KINDS)}"
            )
        if name in declared:
            raise _fail(source, item, "declared twice; node names must be unique, rename one")
        declared[name] = kind
        if "tenant" in entry:
            if kind != "worker":
                raise _fail(source, item, "only workers have a tenant; remove the key")
            tenant_of[name] = _name(entry["tenant"], source, item, "tenant")
    if len(declared) > MAX_NODES:
        raise _fail(
            source, "", f"{len(declared)} nodes; node ids are u16, at most {MAX_NODES} nodes"
        )
    if not any(k == "worker" for k in declared.values()):
        raise _fail(
            source, "", 'no worker declared; add at least one [[node]] with kind = "worker"'
        )
    # Ids: workers first (id == rank), then hosts, then switches, each in file order.
    ordered = [n for kind in NODE_KINDS for n, k in declared.items() if k == kind]
    nodes = [Node(n, declared[n], i, tenant_of.get(n, "")) for i, n in enumerate(ordered)]

    # [tenants.<name>]
    raw_tenants = _table(doc.get("tenants", {}), source, "[tenants]", "write [tenants.<name>]")
    tenants: dict[str, TenantQuota] = {}
    for tname, table in raw_tenants.items():
        item = f"[tenants.{tname}]"
        tname = _name(tname, source, item, "tenant name")
        table = _table(table, source, item,
                       f"write {item} with slots, memory_bytes, groups and regions")
        _check_keys(table, _TENANT_KEYS, source, item)
        vals: dict[str, int] = {}
        for key in _TENANT_KEYS:
            if key in table:
                v = table[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise _fail(source, item, f"{key} must be a non-negative integer, got {v!r}")
                vals[key] = v
        tenants[tname] = TenantQuota(vals.get("slots"), vals.get("memory_bytes"),
                                     vals.get("groups"), vals.get("regions"))

    # [[link]]
    raw_links = _array_of_tables(doc, "link", source)
    links: list[Link] = []
    pairs: dict[frozenset[str], int] = {}
    for i, entry in enumerate(raw_links, 1):
        item = f"link {i}"
        _check_keys(entry, _LINK_KEYS, source, item)
        for key in ("a", "b", "class"):
            if key not in entry:
                fix = (
                    f'add class = "scaleup" (one of {", ".join(LINK_CLASSES)})'
                    if key == "class"
                    else "every [[link]] needs a, b and class"
                )
                raise _fail(source, item, f"missing key {key!r}; {fix}")
        a = _name(entry["a"], source, item, "a")
        b = _name(entry["b"], source, item, "b")
        for end in (a, b):
            if end not in declared:
                raise _fail(
                    source,
                    item,
                    f"node {end!r} is not declared; declare it in a [[node]] table or fix the name",
                )
        item = f"link {i} ({a} -- {b})"
        cls = entry["class"]
        if cls not in LINK_CLASSES:
            raise _fail(
                source, item, f"unknown class {cls!r}; valid classes: {', '.join(LINK_CLASSES)}"
            )
        if a == b:
            raise _fail(source, item, "links a node to itself; remove it")
        ka, kb = declared[a], declared[b]
        if ka == "worker" and kb == "worker":
            raise _fail(
                source,
                item,
                f"links worker {a!r} directly to worker {b!r}; workers talk through switches, "
                "link each worker to a switch instead",
            )
        if ka != "switch" and kb != "switch":
            raise _fail(
                source,
                item,
                f"links {ka} {a!r} directly to {kb} {b!r}; every link needs a switch at one "
                "end, link each endpoint to a switch instead",
            )
        pair = frozenset((a, b))
        if pair in pairs:
            raise _fail(
                source,
                item,
                f"duplicates link {pairs[pair]}; keep one link per pair "
                "(raise bandwidth_gbps for a fatter pipe)",
            )
        pairs[pair] = i
        params = _params(entry, defaults[cls], source, item)
        links.append(Link(a, b, cast(LinkClass, cls), params))

    # Every worker/host attaches to exactly one switch.
    attach: dict[str, list[str]] = {n: [] for n in declared if declared[n] != "switch"}
    for link in links:
        for end, other in ((link.a, link.b), (link.b, link.a)):
            if end in attach:
                attach[end].append(other)
    for n in ordered:
        if n not in attach:
            continue
        sws = attach[n]
        if not sws:
            raise _fail(
                source,
                f"node {n!r}",
                f"{declared[n]} is not connected to any switch; add a [[link]] from it to a switch",
            )
        if len(sws) > 1:
            raise _fail(
                source,
                f"node {n!r}",
                f"{declared[n]} is linked to {len(sws)} switches ({', '.join(sws)}); "
                "an endpoint attaches to exactly one switch, remove the extra links",
            )

    # The switches form one connected graph.
    switches = [n for n in ordered if declared[n] == "switch"]
    sw_adj: dict[str, list[str]] = {s: [] for s in switches}
    for link in links:
        if declared[link.a] == "switch" and declared[link.b] == "switch":
            sw_adj[link.a].append(link.b)
            sw_adj[link.b].append(link.a)
    seen = {switches[0]}
    queue = deque([switches[0]])
    while queue:
        for other in sw_adj[queue.popleft()]:
            if other not in seen:
                seen.add(other)
                queue.append(other)
    cut = [s for s in switches if s not in seen]
    if cut:
        raise _fail(
            source,
            f"switch {cut[0]!r}",
            f"is not connected to switch {switches[0]!r} (unreachable: {_short_list(cut)}); "
            "add scaleout [[link]]s so all switches form one network",
        )

    # [fabric.host_addresses]
    addrs: dict[str, str] = {}
    for node_name, host in raw_addrs.items():
        item = f"[fabric.host_addresses] {node_name!r}"
        if node_name not in declared:
            raise _fail(
                source, item, "names no declared node; use a [[node]] name or remove the entry"
            )
        if not isinstance(host, str) or not host or any(c.isspace() for c in host) or "/" in host:
            raise _fail(source, item, f"must be a hostname or IP address string, got {host!r}")
        if len(host) > _MAX_HOSTNAME:
            raise _fail(
                source,
                item,
                f"{_clip(host)!r} is {len(host)} characters long; a hostname has at most "
                f"{_MAX_HOSTNAME}",
            )
        addrs[node_name] = host
    if transport == "ipc":
        remote = [n for n, h in addrs.items() if not _is_loopback(h)]
        if remote:
            raise _fail(
                source,
                "[fabric]",
                f"transport 'ipc' works on one host only but node {remote[0]!r} has address "
                f'{addrs[remote[0]]!r}; set transport = "tcp"',
            )
    elif base_port + len(nodes) - 1 > 65535:
        raise _fail(
            source,
            "[fabric]",
            f"base_port {base_port} + {len(nodes) - 1} (highest node id) exceeds port 65535; "
            "lower base_port",
        )

    return Topology(
        nodes,
        links,
        name=fname,
        transport=transport,
        base_port=base_port,
        host_addresses=addrs,
        defaults=defaults,
        tenants=tenants,
        source=source,
        congestion=_congestion(doc, source),
    )


def _congestion(doc: Mapping[str, Any], source: str) -> CongestionSettings:
    """The ``[congestion]`` table (docs/CONGESTION.md), checked."""
    table = _table(doc.get("congestion", {}), source, "[congestion]",
                   f"write [congestion] with keys {', '.join(CONGESTION_KEYS)}")
    try:
        return CongestionSettings.from_table(table)
    except CongestionConfigError as exc:
        raise _fail(source, "[congestion]", str(exc)) from None


def loads(text: str, source: str = "<string>") -> Topology:
    """Parse and validate topology TOML ``text``; ``source`` names it in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(source, "", f"TOML syntax error: {exc}; fix the file at that line") from None
    except RecursionError:
        raise _fail(source, "", "values nested too deeply to read; a topology file needs "
                    "no nesting beyond tables of links and nodes") from None
    return _build(doc, source)


def load(path: str | os.PathLike[str]) -> Topology:
    """Read, parse and validate the topology file at ``path``."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _fail(source, "", f"cannot read the file: {exc.strerror}; check the path") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(source, "", "is not UTF-8 text; save it as UTF-8") from None
    return loads(text, source)


# ---------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------


def _count(value: object, what: str, source: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(source, "", f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _fabric_table(name: str, transport: str, base_port: int) -> dict[str, Any]:
    return {"name": name, "transport": transport, "base_port": base_port}


def star(
    workers: int,
    hosts: int = 1,
    cls: str = "scaleup",
    *,
    name: str | None = None,
    transport: str = "ipc",
    base_port: int = DEFAULT_BASE_PORT,
    **link_params: Any,
) -> Topology:
    """One switch ``sw0`` with workers ``w0..`` and hosts ``host0..`` attached.

    ``link_params`` (``latency_us``, ``bandwidth_gbps``, ``loss``, ``mtu``) set
    the ``[defaults.<cls>]`` table that every link of the star uses.
    """
    source = "<star>"
    workers = _count(workers, "workers", source)
    hosts = _count(hosts, "hosts", source, minimum=0)
    if workers + hosts + 1 > MAX_NODES:
        raise _fail(source, "", f"{workers} workers + {hosts} hosts + 1 switch; node ids are "
                    f"u16, at most {MAX_NODES} nodes")
    if cls not in LINK_CLASSES:
        raise _fail(source, "", f"unknown class {cls!r}; valid classes: {', '.join(LINK_CLASSES)}")
    _check_keys(link_params, LINK_PARAM_KEYS, source, "star() link parameters")
    nodes = [{"name": f"w{i}", "kind": "worker"} for i in range(workers)]
    nodes += [{"name": f"host{i}", "kind": "host"} for i in range(hosts)]
    nodes.append({"name": "sw0", "kind": "switch"})
    links = [{"a": n["name"], "b": "sw0", "class": cls} for n in nodes[:-1]]
    doc = {
        "fabric": _fabric_table(name or f"star{workers}", transport, base_port),
        "defaults": {cls: dict(link_params)},
        "node": nodes,
        "link": links,
    }
    return _build(doc, source)


def leaf_spine(
    leaves: int,
    workers_per_leaf: int,
    spines: int = 1,
    oversubscription: float = 1.0,
    leaf_bandwidth_gbps: float = 0.0,
    *,
    hosts: int = 1,
    leaf_latency_us: float = 0.0,
    spine_latency_us: float = 0.0,
    host_bandwidth_gbps: float | None = None,
    loss: float = 0.0,
    mtu: int | None = None,
    llr: bool = False,
    name: str | None = None,
    transport: str = "ipc",
    base_port: int = DEFAULT_BASE_PORT,
) -> Topology:
    """Two-tier fabric: ``leaves`` leaf switches of ``workers_per_leaf`` workers each,
    every leaf linked to every spine.

    Worker-leaf links are ``scaleup`` at ``leaf_bandwidth_gbps``; leaf-spine
    links are ``scaleout`` with the bandwidth that makes each leaf's down:up
    ratio equal ``oversubscription`` (``K * leaf_bw / (ratio * spines)`` per
    uplink). Hosts attach to ``spine0`` over ``scaleout`` at
    ``host_bandwidth_gbps`` (default: one worker link's bandwidth). ``loss``,
    ``mtu`` and ``llr`` (link-level retry) apply to every link. A ratio other than 1
    needs shaped leaf links.
    Names: workers ``w0..`` (leaf-major), ``leaf0..``, ``spine0..``, ``host0..``.
    """
    source = "<leaf_spine>"
    leaves = _count(leaves, "leaves", source)
    workers_per_leaf = _count(workers_per_leaf, "workers_per_leaf", source)
    spines = _count(spines, "spines", source)
    hosts = _count(hosts, "hosts", source, minimum=0)
    if (
        isinstance(oversubscription, bool)
        or not isinstance(oversubscription, int | float)
        or not math.isfinite(oversubscription)
        or oversubscription <= 0
    ):
        raise _fail(
            source,
            "",
            f"oversubscription must be a number > 0 (2 means 2:1), got {oversubscription!r}",
        )
    problem = _param_problem("bandwidth_gbps", leaf_bandwidth_gbps)
    if problem:
        raise _fail(source, "", f"leaf_{problem}")
    if oversubscription != 1 and leaf_bandwidth_gbps == 0:
        raise _fail(
            source,
            "",
            f"oversubscription {oversubscription:g}:1 needs shaped links; "
            "set leaf_bandwidth_gbps > 0 (unshaped links have no ratio)",
        )
    total = leaves * workers_per_leaf + hosts + spines + leaves
    if total > MAX_NODES:  # refused before a list of them is built
        raise _fail(source, "", f"{leaves} leaves x {workers_per_leaf} workers (+ {hosts} hosts, "
                    f"{spines + leaves} switches) = {total} nodes; node ids are u16, at most "
                    f"{MAX_NODES} nodes")
    uplink_bw = leaf_bandwidth_gbps * workers_per_leaf / (oversubscription * spines)
    common: dict[str, Any] = {"loss": loss}
    if mtu is not None:
        common["mtu"] = mtu
    if llr:
        common["llr"] = True
    nodes = [{"name": f"w{i}", "kind": "worker"} for i in range(leaves * workers_per_leaf)]
    nodes += [{"name": f"host{i}", "kind": "host"} for i in range(hosts)]
    # Spines before leaves so spine0 gets the lowest switch id (it wins root ties).
    nodes += [{"name": f"spine{i}", "kind": "switch"} for i in range(spines)]
    nodes += [{"name": f"leaf{i}", "kind": "switch"} for i in range(leaves)]
    links: list[dict[str, Any]] = []
    for w in range(leaves * workers_per_leaf):
        links.append({"a": f"w{w}", "b": f"leaf{w // workers_per_leaf}", "class": "scaleup"})
    for leaf in range(leaves):
        for sp in range(spines):
            links.append({"a": f"leaf{leaf}", "b": f"spine{sp}", "class": "scaleout"})
    host_bw = leaf_bandwidth_gbps if host_bandwidth_gbps is None else host_bandwidth_gbps
    for h in range(hosts):
        link: dict[str, Any] = {"a": f"host{h}", "b": "spine0", "class": "scaleout"}
        if host_bw != uplink_bw:
            link["bandwidth_gbps"] = host_bw
        links.append(link)
    default_name = f"leaf_spine_{leaves}x{workers_per_leaf}"
    if spines > 1:
        default_name += f"_s{spines}"
    if oversubscription != 1:
        default_name += f"_os{oversubscription:g}".replace(".", "p")
    doc = {
        "fabric": _fabric_table(name or default_name, transport, base_port),
        "defaults": {
            "scaleup": {
                "latency_us": leaf_latency_us,
                "bandwidth_gbps": leaf_bandwidth_gbps,
                **common,
            },
            "scaleout": {"latency_us": spine_latency_us, "bandwidth_gbps": uplink_bw, **common},
        },
        "node": nodes,
        "link": links,
    }
    return _build(doc, source)


#: A cluster's per-class link figures (``cluster()``), per GPU and per hop. Orders of
#: magnitude of an H100-class system, each with its source (docs/TOPOLOGY.md):
#: scale-up NVLink 4, 18 links x 25 GB/s each way = 450 GB/s per GPU (NVIDIA H100
#: datasheet), sub-microsecond through an NVSwitch; scale-out one 400 Gb/s NIC per
#: GPU (ConnectX-7, as in a DGX H100), about 1 us per cut-through hop with the NIC,
#: RoCE's 4096-byte path MTU; front-end 100 Gb/s datacenter Ethernet, 9000-byte
#: jumbo frames, a few microseconds per hop through host stacks. Scale-up links
#: retry at the link layer (``llr``): a flit that arrives damaged or not at all is
#: replayed by the link, as UALink's link-level retry and NVLink's CRC-checked
#: replay do, so no loss there reaches the protocol's end-to-end recovery; and
#: they are credit-controlled (``credit``): a link sends only into buffer its far
#: end granted, as UALink's and NVLink's link layers do, so they never overflow.
CLUSTER_DEFAULTS: dict[str, dict[str, float | bool]] = {
    "scaleup": {"bandwidth_gbps": 3600.0, "latency_us": 0.5, "mtu": 4096, "llr": True,
                "credit": True},
    "scaleout": {"bandwidth_gbps": 400.0, "latency_us": 1.0, "mtu": 4096},
    "frontend": {"bandwidth_gbps": 100.0, "latency_us": 5.0, "mtu": 9000},
}


def cluster(
    domains: int,
    gpus_per_domain: int,
    *,
    domains_per_leaf: int = 1,
    spines: int = 1,
    oversubscription: float = 1.0,
    hosts: int = 1,
    scaleup: Mapping[str, float | bool] | None = None,
    scaleout: Mapping[str, float | bool] | None = None,
    frontend: Mapping[str, float | bool] | None = None,
    name: str | None = None,
    transport: str = "ipc",
    base_port: int = DEFAULT_BASE_PORT,
) -> Topology:
    """A GPU cluster of three networks: ``domains`` scale-up domains of
    ``gpus_per_domain`` workers, each behind its scale-up switch ``su<d>``
    (``scaleup`` links); the scale-up switches on scale-out leaves
    (``domains_per_leaf`` each) and the leaves on ``spines`` (``scaleout``); hosts
    on ``spine0`` over the front-end (``frontend``).

    A domain's uplink carries its GPUs' scale-out NICs (``gpus_per_domain`` x the
    scale-out rate); a leaf's uplinks make its down:up ratio ``oversubscription``.
    ``scaleup``/``scaleout``/``frontend`` override :data:`CLUSTER_DEFAULTS` keys.
    One tree: scale-out traffic crosses the domain's switch (a real GPU has its
    own NIC; the uplink's bandwidth is theirs together).
    """
    source = "<cluster>"
    domains = _count(domains, "domains", source)
    gpus_per_domain = _count(gpus_per_domain, "gpus_per_domain", source)
    domains_per_leaf = _count(domains_per_leaf, "domains_per_leaf", source)
    spines = _count(spines, "spines", source)
    hosts = _count(hosts, "hosts", source, minimum=0)
    if domains % domains_per_leaf:
        raise _fail(source, "", f"{domains} domains do not fill leaves of {domains_per_leaf}; "
                    "choose a divisor")
    if isinstance(oversubscription, bool) or not isinstance(oversubscription, int | float) \
            or not math.isfinite(oversubscription) or oversubscription < 1:
        raise _fail(source, "", f"oversubscription must be a number >= 1 (2 means 2:1), got "
                    f"{oversubscription!r}")
    leaves = domains // domains_per_leaf
    workers = domains * gpus_per_domain
    total = workers + hosts + domains + leaves + spines
    if total > MAX_NODES:
        raise _fail(source, "", f"{total} nodes; node ids are u16, at most {MAX_NODES}")
    params = {}
    for cls, given in (("scaleup", scaleup), ("scaleout", scaleout), ("frontend", frontend)):
        p = dict(CLUSTER_DEFAULTS[cls])
        p.update(given or {})
        _check_keys(p, LINK_PARAM_KEYS, source, f"{cls} link parameters")
        params[cls] = p
    nic = params["scaleout"]["bandwidth_gbps"]
    domain_up = nic * gpus_per_domain
    leaf_up = domain_up * domains_per_leaf / (oversubscription * spines)
    nodes = [{"name": f"w{i}", "kind": "worker"} for i in range(workers)]
    nodes += [{"name": f"host{i}", "kind": "host"} for i in range(hosts)]
    # spines first: spine0 gets the lowest switch id (it wins root ties)
    nodes += [{"name": f"spine{i}", "kind": "switch"} for i in range(spines)]
    nodes += [{"name": f"leaf{i}", "kind": "switch"} for i in range(leaves)]
    nodes += [{"name": f"su{i}", "kind": "switch"} for i in range(domains)]
    links: list[dict[str, Any]] = [
        {"a": f"w{w}", "b": f"su{w // gpus_per_domain}", "class": "scaleup"}
        for w in range(workers)]
    links += [{"a": f"su{d}", "b": f"leaf{d // domains_per_leaf}", "class": "scaleout",
               "bandwidth_gbps": domain_up} for d in range(domains)]
    links += [{"a": f"leaf{lf}", "b": f"spine{sp}", "class": "scaleout",
               "bandwidth_gbps": leaf_up} for lf in range(leaves) for sp in range(spines)]
    links += [{"a": f"host{h}", "b": "spine0", "class": "frontend"} for h in range(hosts)]
    default_name = f"cluster_{domains}x{gpus_per_domain}"
    if oversubscription != 1:
        default_name += f"_os{oversubscription:g}".replace(".", "p")
    doc = {"fabric": _fabric_table(name or default_name, transport, base_port),
           "defaults": params, "node": nodes, "link": links}
    return _build(doc, source)


# ---------------------------------------------------------------------------
# text helpers
# ---------------------------------------------------------------------------


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form; valid TOML for finite floats
    if isinstance(value, str):
        out = ['"']
        for ch in value:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)
    raise TypeError(f"cannot write {value!r} as TOML")


def _short_list(names: Iterable[str], limit: int = 8) -> str:
    items = list(names)
    if len(items) <= limit:
        return " ".join(items)
    return " ".join(items[: limit - 2]) + f" ... {items[-1]} ({len(items)})"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _id_range(nodes: Sequence[Node]) -> str:
    if not nodes:
        return ""
    lo, hi = nodes[0].id, nodes[-1].id
    return f"(id {lo})" if lo == hi else f"(ids {lo}-{hi})"


def _ratio(r: float) -> str:
    if math.isinf(r):
        return "unbounded"
    return f"{r:.3g}:1"


def _gbps(x: float) -> str:
    return "unshaped" if math.isinf(x) else f"{x:g} Gbps"


# ---------------------------------------------------------------------------
# CLI entry points (wired as `semfab topo check|gen`)
# ---------------------------------------------------------------------------


def _run_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | int:
    # argparse exits on --help / bad usage; turn that into a return code.
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


def _gen_congestion(args: argparse.Namespace) -> CongestionSettings:
    """`semfab topo gen`'s congestion flags as settings (a refusal as a TopologyError)."""
    fields: dict[str, Any] = {"buffer_bytes": args.buffer_bytes, "buffer_alpha": args.buffer_alpha,
                              "trim": args.trim, "pfc": args.pfc, "credit": bool(args.credit),
                              "ecn_kmin_bytes": args.ecn_kmin_bytes,
                              "ecn_kmax_bytes": args.ecn_kmax_bytes, "ecn_pmax": args.ecn_pmax,
                              "rto_max_us": args.rto_max_us}
    if args.cc is not None:
        fields["cc"] = args.cc
    try:
        base = CongestionSettings(**fields)
        if not args.class_congestion:
            return base
        table: dict[str, Any] = base.to_table()
        for given in args.class_congestion:
            cls, keys = _class_flag(given)
            table.setdefault(cls, {}).update(keys)
        return CongestionSettings.from_table(table)
    except CongestionConfigError as exc:
        raise TopologyError(f"semfab topo gen: {exc}") from None


def _class_flag(text: str) -> tuple[str, dict[str, Any]]:
    """``--class-congestion CLASS:KEY=V,...`` as (class, keys); values read as TOML
    would (true/false, whole numbers, numbers, else a word)."""
    cls, sep, rest = text.partition(":")
    if not sep or not rest or cls not in LINK_CLASSES:
        raise CongestionConfigError(
            f"--class-congestion {text!r}: write CLASS:KEY=VALUE[,KEY=VALUE], CLASS one of "
            f"{', '.join(LINK_CLASSES)} (e.g. frontend:cc=dctcp,buffer_bytes=1000000)")
    keys: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CongestionConfigError(f"--class-congestion {text!r}: {item!r} is not "
                                        "KEY=VALUE")
        v = value.strip()
        parsed: Any = v
        if v in ("true", "false"):
            parsed = v == "true"
        else:
            for kind in (int, float):
                try:
                    parsed = kind(v)
                    break
                except ValueError:
                    continue
        keys[key.strip()] = parsed
    return cls, keys


def check_main(argv: Sequence[str]) -> int:
    """``semfab topo check FILE``: print a summary (exit 0) or the error (exit 2)."""
    parser = argparse.ArgumentParser(
        prog="semfab topo check",
        description="Validate a topology file and print nodes, links, the switch tree "
        "and each leaf's oversubscription. Exit 0 when valid, 2 with a one-line error.",
    )
    parser.add_argument("file", metavar="FILE", help="topology TOML file (see docs/TOPOLOGY.md)")
    args = _run_parser(parser, argv)
    if isinstance(args, int):
        return args
    try:
        topo = load(args.file)
    except TopologyError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.file}: OK")
    print(topo.summary())
    return 0


def gen_main(argv: Sequence[str]) -> int:
    """``semfab topo gen``: write a star or leaf-spine topology as TOML."""
    parser = argparse.ArgumentParser(
        prog="semfab topo gen",
        description="Generate a topology file. A star (--workers N: one switch sw0) or a "
        "leaf-spine (--leaves L --per-leaf K: workers on leaves, leaves on spines). "
        "Links are unshaped unless --bandwidth-gbps is given.",
        epilog="examples: semfab topo gen --workers 8 -o star8.toml; "
        "semfab topo gen --leaves 4 --per-leaf 4 --oversubscription 2 --bandwidth-gbps 8",
    )
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--workers", type=int, metavar="N", help="star with N workers")
    shape.add_argument("--leaves", type=int, metavar="L", help="leaf-spine with L leaf switches")
    shape.add_argument("--cluster", type=int, metavar="D",
                       help="a GPU cluster of D scale-up domains (--gpus-per-domain each) on a "
                       "scale-out leaf/spine, hosts on the front-end; class figures from "
                       "docs/TOPOLOGY.md unless given")
    clus = parser.add_argument_group("cluster (--cluster)")
    clus.add_argument("--gpus-per-domain", type=int, default=8, metavar="G",
                      help="workers in each scale-up domain")
    clus.add_argument("--domains-per-leaf", type=int, default=1, metavar="K",
                      help="scale-up domains under each scale-out leaf")
    for cls in LINK_CLASSES:
        clus.add_argument(f"--{cls}-gbps", type=float, default=None, metavar="G",
                          help=f"{cls} link rate per GPU (default "
                          f"{CLUSTER_DEFAULTS[cls]['bandwidth_gbps']:g})")
    parser.add_argument(
        "--per-leaf", type=int, default=None, metavar="K", help="workers per leaf (leaf-spine)"
    )
    parser.add_argument("--spines", type=int, default=1, metavar="S", help="spines (default 1)")
    parser.add_argument(
        "--oversubscription",
        type=float,
        default=1.0,
        metavar="R",
        help="leaf down:up bandwidth ratio, e.g. 2 for 2:1 (needs --bandwidth-gbps)",
    )
    parser.add_argument("--hosts", type=int, default=1, metavar="H", help="host nodes (default 1)")
    parser.add_argument(
        "--class",
        dest="cls",
        default="scaleup",
        choices=LINK_CLASSES,
        help="link class of a star's links (default scaleup)",
    )
    parser.add_argument(
        "--bandwidth-gbps",
        "--leaf-bandwidth-gbps",
        type=float,
        default=0.0,
        metavar="G",
        help="worker link bandwidth in Gbit/s; 0 = unshaped (default)",
    )
    parser.add_argument(
        "--latency-us", type=float, default=0.0, metavar="US", help="worker link latency (µs)"
    )
    parser.add_argument(
        "--spine-latency-us", type=float, default=0.0, metavar="US", help="leaf-spine latency (µs)"
    )
    parser.add_argument("--loss", type=float, default=0.0, metavar="P", help="loss probability")
    parser.add_argument("--mtu", type=int, default=None, metavar="BYTES", help="link MTU")
    parser.add_argument("--llr", action=argparse.BooleanOptionalAction, default=None,
                        help="link-level retry: a link replays a frame lost or damaged on it "
                        "(every link of a star or leaf-spine; a cluster's scale-up links have "
                        "it unless --no-llr)")
    parser.add_argument("--name", default=None, help="fabric name (default from the shape)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="ipc", help="default ipc")
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="tcp base port")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    cong = parser.add_argument_group(
        "congestion ([congestion], docs/CONGESTION.md; absent: the scenario's defaults)")
    cong.add_argument("--buffer-bytes", type=int, default=None, metavar="B",
                      help="each switch's shared buffer")
    cong.add_argument("--buffer-alpha", type=float, default=math.inf, metavar="A",
                      help="dynamic threshold: a queue may hold A x the free buffer")
    cong.add_argument("--trim", action="store_true", help="trim payloads instead of dropping")
    cong.add_argument("--pfc", action="store_true", help="lossless data class (PFC)")
    cong.add_argument("--credit", action=argparse.BooleanOptionalAction, default=None,
                      help="credit-based flow control on every link (the scale-up way: a "
                      "link sends only into buffer its far end granted); a cluster's "
                      "scale-up links have it unless --no-credit")
    cong.add_argument("--ecn-kmin-bytes", type=int, default=None, metavar="B",
                      help="ECN: no mark at or below")
    cong.add_argument("--ecn-kmax-bytes", type=int, default=None, metavar="B",
                      help="ECN: every frame marked above")
    cong.add_argument("--ecn-pmax", type=float, default=None, metavar="P",
                      help="ECN: marking probability at Kmax")
    cong.add_argument("--cc", default=None, metavar="POLICY",
                      help="sender congestion control (nscc, dcqcn, eqds, dctcp, none)")
    cong.add_argument("--rto-max-us", type=float, default=None, metavar="US",
                      help="streams' retransmission-timeout ceiling (default with "
                      "--buffer-bytes: two windows at the path's bottleneck rate)")
    cong.add_argument("--class-congestion", action="append", default=[],
                      metavar="CLASS:KEY=V,...",
                      help="a network class's own settings over the ones above, e.g. "
                      "frontend:cc=dctcp,buffer_bytes=1000000 or scaleout:pfc=true,"
                      "buffer_bytes=4000000 ([congestion.CLASS]; repeat per class)")
    args = _run_parser(parser, argv)
    if isinstance(args, int):
        return args
    try:
        if args.workers is not None:
            params: dict[str, Any] = {
                "latency_us": args.latency_us,
                "bandwidth_gbps": args.bandwidth_gbps,
                "loss": args.loss,
            }
            if args.mtu is not None:
                params["mtu"] = args.mtu
            if args.llr:
                params["llr"] = True
            topo = star(
                args.workers,
                args.hosts,
                args.cls,
                name=args.name,
                transport=args.transport,
                base_port=args.base_port,
                **params,
            )
        elif args.cluster is not None:
            over: dict[str, dict[str, float | bool]] = {c: {} for c in LINK_CLASSES}
            for cls in LINK_CLASSES:
                v = getattr(args, f"{cls}_gbps")
                if v is not None:
                    over[cls]["bandwidth_gbps"] = v
            if args.mtu is not None:
                over["scaleup"]["mtu"] = over["scaleout"]["mtu"] = args.mtu
            if args.llr is not None:
                over["scaleup"]["llr"] = args.llr
            if args.credit is False:
                over["scaleup"]["credit"] = False
            topo = cluster(args.cluster, args.gpus_per_domain,
                           domains_per_leaf=args.domains_per_leaf, spines=args.spines,
                           oversubscription=args.oversubscription, hosts=args.hosts,
                           scaleup=over["scaleup"], scaleout=over["scaleout"],
                           frontend=over["frontend"], name=args.name,
                           transport=args.transport, base_port=args.base_port)
        else:
            if args.per_leaf is None:
                raise TopologyError("semfab topo gen: --leaves needs --per-leaf K")
            topo = leaf_spine(
                args.leaves,
                args.per_leaf,
                args.spines,
                args.oversubscription,
                args.bandwidth_gbps,
                hosts=args.hosts,
                leaf_latency_us=args.latency_us,
                spine_latency_us=args.spine_latency_us,
                loss=args.loss,
                mtu=args.mtu,
                llr=bool(args.llr),
                name=args.name,
                transport=args.transport,
                base_port=args.base_port,
            )
        topo = topo.with_congestion(_gen_congestion(args))
        text = topo.to_toml()
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    except TopologyError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2
    except OSError as write_error:  # a name of its own: see docs/ARCHITECTURE.md (mypyc)
        print(f"semfab: error: cannot write {args.output}: {write_error.strerror}",
              file=sys.stderr)
        return 2
    return 0
