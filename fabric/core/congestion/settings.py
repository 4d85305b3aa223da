"""The congestion settings a topology file carries: its ``[congestion]`` table.

One table per fabric, applied to every switch (buffers, marking, trimming, PFC)
and every sender (the policy). A network class may have its own table,
``[congestion.scaleup]``, ``[congestion.scaleout]`` or ``[congestion.frontend]``,
whose keys override the fabric's for that class: a switch port queues by the
class of its link, a stream follows the outermost class on its route (front-end
over scale-out over scale-up). Absent keys keep the scenario's defaults (htsim's
for queues and marking, HPCC's for PFC: :mod:`fabric.core.congestion.config`)::

    [congestion]
    buffer_bytes = 150000      # each switch's shared buffer
    buffer_alpha = inf         # dynamic threshold (inf: the buffer's size only)
    trim = true                # cut payloads instead of dropping frames
    ecn_kmin_bytes = 30000     # RED marking: none at or below ...
    ecn_kmax_bytes = 120000    # ... every frame above
    ecn_pmax = 1.0
    pfc = false                # lossless data class (not with trim)
    credit = false             # credit-based flow control on every link (not with pfc
                               # or trim; a link's own ``credit`` sets it per link)
    cc = "nscc"                # streams' sender policy: none, dcqcn, nscc, or registered
                               # (absent: the reliability window alone)
    base_rtt_us = 2000.0       # the unloaded round trip policies assume (absent: the
                               # topology's links; an emulator adds its software's)
    rto_max_us = 40000.0       # the retransmit timers' ceiling (absent: 1 s, or with a
                               # buffer two RTO floors: two windows at the bottleneck)

    [congestion.frontend]      # the front-end's ports and streams: lossy, TCP-like
    cc = "dctcp"
    buffer_bytes = 1000000

Pure: parsing and checks, one-line :class:`CongestionConfigError` on anything
impossible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fabric.core.congestion.config import CongestionConfigError, check_bytes
from fabric.core.congestion.policy import CC_POLICIES

__all__ = ["CONGESTION_KEYS", "NETWORK_CLASSES", "CongestionSettings", "class_rank"]

#: Keys of ``[congestion]``.
CONGESTION_KEYS = ("buffer_bytes", "buffer_alpha", "trim", "ecn_kmin_bytes", "ecn_kmax_bytes",
                   "ecn_pmax", "pfc", "credit", "cc", "base_rtt_us", "rto_max_us")
#: The network classes a ``[congestion.<class>]`` table may name (a topology's link
#: classes), innermost first: a route's outermost class sets its streams' settings.
NETWORK_CLASSES = ("scaleup", "scaleout", "frontend")


def class_rank(cls: str) -> int:
    """How far out a network class is: scale-up 0, scale-out 1, front-end 2."""
    return NETWORK_CLASSES.index(cls) if cls in NETWORK_CLASSES else 0


@dataclass(frozen=True)
class CongestionSettings:
    """A fabric's queue, marking, PFC and congestion-control settings (None: the
    scenario's default)."""

    buffer_bytes: int | None = None
    buffer_alpha: float = math.inf
    trim: bool = False
    ecn_kmin_bytes: int | None = None
    ecn_kmax_bytes: int | None = None
    ecn_pmax: float | None = None
    pfc: bool = False
    #: credit-based flow control on every link, the scale-up way (a link's own
    #: ``credit`` parameter sets it per link)
    credit: bool = False
    #: the senders' policy; None: streams keep the reliability window alone (the
    #: congestion scenarios default to nscc)
    cc: str | None = None
    #: the unloaded round trip (microseconds) the policies start from; None: from
    #: the topology's links (each latency both ways, both serialisations)
    base_rtt_us: float | None = None
    #: the retransmit timers' ceiling (microseconds): streams, aggregation and MoE;
    #: None: 1 s, lowered where ``buffer_bytes`` is set (NodeState.stream_rto)
    rto_max_us: float | None = None
    #: per network class, the keys its ``[congestion.<class>]`` table sets
    classes: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.buffer_bytes is not None:
            check_bytes("buffer_bytes", self.buffer_bytes)
        if not (isinstance(self.buffer_alpha, (int, float)) and self.buffer_alpha > 0):
            raise CongestionConfigError(f"buffer_alpha must be a positive number (inf: no "
                                        f"threshold), got {self.buffer_alpha!r}")
        for key in ("ecn_kmin_bytes", "ecn_kmax_bytes"):
            v = getattr(self, key)
            if v is not None:
                check_bytes(key, v)
        lo, hi = self.ecn_kmin_bytes, self.ecn_kmax_bytes
        if lo is not None and hi is not None and lo > hi:
            raise CongestionConfigError(f"ecn_kmin_bytes {lo} is above ecn_kmax_bytes {hi}; "
                                        "Kmin must be <= Kmax")
        p = self.ecn_pmax
        if p is not None and not (isinstance(p, (int, float)) and 0.0 < p <= 1.0):
            raise CongestionConfigError(f"ecn_pmax must be in (0, 1], got {p!r}")
        if self.credit and (self.pfc or self.trim):
            raise CongestionConfigError("credit with pfc or trim: credit-based links are "
                                        "lossless by themselves; choose one")
        if self.pfc and self.trim:
            raise CongestionConfigError("pfc and trim: a lossless class is never trimmed; "
                                        "choose one")
        for key in ("base_rtt_us", "rto_max_us"):
            b = getattr(self, key)
            if b is not None and not (isinstance(b, (int, float)) and not isinstance(b, bool)
                                      and 0.0 < b < 1e7):
                raise CongestionConfigError(f"{key} must be a positive number of "
                                            f"microseconds (under 10 s), got {b!r}")
        if self.cc is not None and self.cc not in CC_POLICIES:
            raise CongestionConfigError(f"cc {self.cc!r} is not a known policy; choose "
                                        f"{', '.join(sorted(CC_POLICIES))}")
        for cls, _keys in self.classes:
            try:
                self.for_class(cls)  # each class's settings are checked as a whole
            except CongestionConfigError as exc:
                raise CongestionConfigError(f"[congestion.{cls}]: {exc}") from None

    def for_class(self, cls: str | None) -> CongestionSettings:
        """The settings of network class ``cls``: the fabric's, with what its
        ``[congestion.<cls>]`` table overrides (no class tables in the result)."""
        if not self.classes:
            return self
        return _class_settings(self, cls)

    def every_class(self) -> list[CongestionSettings]:
        """The fabric's settings and each class's that has its own table."""
        return [self.for_class(None), *(self.for_class(n) for n, _ in self.classes)]

    def for_classes(self, classes: list[str]) -> CongestionSettings:
        """The settings of a route over links of ``classes``: its outermost class's."""
        if not self.classes or not classes:
            return self.for_class(None)
        return self.for_class(max(classes, key=class_rank))

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> CongestionSettings:
        """Read a ``[congestion]`` table (as TOML parses it), checking every key and
        type, with its ``[congestion.<class>]`` sub-tables."""
        out = _keys(table, sub_tables=True)
        classes = []
        for name in NETWORK_CLASSES:
            sub = table.get(name)
            if sub is None:
                continue
            if not isinstance(sub, Mapping):
                raise CongestionConfigError(f"{name} must be a table ([congestion.{name}]), "
                                            f"got {sub!r}")
            try:
                keys = _keys(sub, sub_tables=False)
            except CongestionConfigError as exc:
                raise CongestionConfigError(f"[congestion.{name}]: {exc}") from None
            classes.append((name, tuple(sorted(keys.items()))))
        if classes:
            out["classes"] = tuple(classes)
        return cls(**out)

    def to_table(self) -> dict[str, Any]:
        """The settings that differ from the defaults, as a ``[congestion]`` table (a
        class's own keys as its sub-table)."""
        default = CongestionSettings()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "classes" and getattr(self, f.name) != getattr(default, f.name)}
        for name, keys in self.classes:
            out[name] = dict(keys)
        return out

    @property
    def is_default(self) -> bool:
        return not self.to_table()


def _keys(table: Mapping[str, Any], *, sub_tables: bool) -> dict[str, Any]:
    """The checked keys of one ``[congestion]`` table (its class tables skipped when
    ``sub_tables``)."""
    allowed = set(CONGESTION_KEYS) | (set(NETWORK_CLASSES) if sub_tables else set())
    unknown = sorted(set(table) - allowed)
    if unknown:
        extra = f"; a class's own table: [congestion.{'|'.join(NETWORK_CLASSES)}]" \
            if sub_tables else ""
        raise CongestionConfigError(f"unknown key {unknown[0]!r}; valid keys: "
                                    f"{', '.join(CONGESTION_KEYS)}{extra}")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in NETWORK_CLASSES:
            continue
        if key in ("trim", "pfc", "credit"):
            if not isinstance(value, bool):
                raise CongestionConfigError(f"{key} must be true or false, got {value!r}")
        elif key == "cc":
            if not isinstance(value, str):
                raise CongestionConfigError(f"cc must be a policy name, got {value!r}")
        elif key.endswith("_bytes"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise CongestionConfigError(f"{key} must be a whole number of bytes, "
                                            f"got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CongestionConfigError(f"{key} must be a number, got {value!r}")
        floats = ("buffer_alpha", "ecn_pmax", "base_rtt_us", "rto_max_us")
        out[key] = float(value) if key in floats else value
    return out


#: (settings, class) -> that class's settings (few of each: a cache, not a leak)
_BY_CLASS: dict[tuple[CongestionSettings, str | None], CongestionSettings] = {}


def _class_settings(base: CongestionSettings, cls: str | None) -> CongestionSettings:
    key = (base, cls)
    got = _BY_CLASS.get(key)
    if got is None:
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                  if f.name != "classes"}
        fields.update(dict(base.classes).get(cls, ()) if cls is not None else ())
        got = _BY_CLASS[key] = CongestionSettings(**fields)
    return got
