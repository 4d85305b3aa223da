"""The congestion settings a topology file carries: its ``[congestion]`` table.

One table per fabric, applied to every switch (buffers, marking, trimming, PFC)
and every sender (the policy). Absent keys keep the scenario's defaults (htsim's
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

__all__ = ["CONGESTION_KEYS", "CongestionSettings"]

#: Keys of ``[congestion]``.
CONGESTION_KEYS = ("buffer_bytes", "buffer_alpha", "trim", "ecn_kmin_bytes", "ecn_kmax_bytes",
                   "ecn_pmax", "pfc", "credit", "cc", "base_rtt_us", "rto_max_us")


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

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> CongestionSettings:
        """Read a ``[congestion]`` table (as TOML parses it), checking every key and type."""
        unknown = sorted(set(table) - set(CONGESTION_KEYS))
        if unknown:
            raise CongestionConfigError(f"unknown key {unknown[0]!r}; valid keys: "
                                        f"{', '.join(CONGESTION_KEYS)}")
        out: dict[str, Any] = {}
        for key, value in table.items():
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
        return cls(**out)

    def to_table(self) -> dict[str, Any]:
        """The settings that differ from the defaults, as a ``[congestion]`` table."""
        default = CongestionSettings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    @property
    def is_default(self) -> bool:
        return not self.to_table()
