"""Named constants of the congestion mechanisms, each with its source, and the
one error their settings raise.

Two reference simulators set our defaults:

* **UEC htsim** (the Ultra Ethernet Consortium's packet simulator): 100 Gb/s links,
  4150-byte MTU, a 12 us base RTT over three tiers, a queue of one BDP per port
  with trimming (five without), ECN from 0.2 to 0.8 BDP, packets trimmed to a
  64-byte header;
* **HPCC's ns-3** (Li et al., SIGCOMM 2019, and its public code): a 32 MB shared
  buffer per switch at 100 Gb/s, ECN Kmin/Kmax 400/1600 KB with Pmax 0.2, PFC
  thresholds of one eighth of the free buffer, headroom of three times
  rate x link delay.

The module is pure: numbers and checks, no clock, no I/O.
"""

from __future__ import annotations

import math

__all__ = [
    "CongestionConfigError",
    "HTSIM_LINK_GBPS",
    "HTSIM_MTU",
    "HTSIM_BASE_RTT_S",
    "HTSIM_ECN_KMIN_BDP",
    "HTSIM_ECN_KMAX_BDP",
    "HTSIM_QUEUE_BDP_TRIM",
    "HTSIM_QUEUE_BDP_DROP",
    "TRIM_HEADER_BYTES",
    "HPCC_BUFFER_BYTES",
    "HPCC_ECN_KMIN",
    "HPCC_ECN_KMAX",
    "HPCC_ECN_PMAX",
    "HPCC_PFC_ALPHA",
    "HPCC_HEADROOM_LINK_DELAYS",
    "MAX_BUFFER_BYTES",
    "bdp_bytes",
    "check_bytes",
]


class CongestionConfigError(ValueError):
    """A congestion setting is impossible; ``str(err)`` is one line naming the
    setting, what is wrong and how to fix it."""


#: htsim's default link rate (Gb/s).
HTSIM_LINK_GBPS = 100.0
#: htsim's default MTU on the wire (bytes, header included).
HTSIM_MTU = 4150
#: htsim's base RTT of its three-tier fabric (seconds).
HTSIM_BASE_RTT_S = 12e-6
#: htsim's ECN marking thresholds, as fractions of one BDP of queue.
HTSIM_ECN_KMIN_BDP = 0.2
HTSIM_ECN_KMAX_BDP = 0.8
#: htsim's queue per port in BDPs: with trimming, and with plain tail drop.
HTSIM_QUEUE_BDP_TRIM = 1.0
HTSIM_QUEUE_BDP_DROP = 5.0
#: What a trimmed packet keeps: its header (htsim and the UET spec: 64 bytes).
TRIM_HEADER_BYTES = 64

#: HPCC's ns-3: shared buffer per switch at 100 Gb/s (bytes).
HPCC_BUFFER_BYTES = 32 * 1000 * 1000
#: HPCC's ns-3 ECN at 100 Gb/s: Kmin, Kmax (bytes) and Pmax.
HPCC_ECN_KMIN = 400 * 1000
HPCC_ECN_KMAX = 1600 * 1000
HPCC_ECN_PMAX = 0.2
#: HPCC's ns-3 PFC dynamic threshold: an ingress queue pauses above this
#: fraction of the free shared buffer.
HPCC_PFC_ALPHA = 1.0 / 8
#: HPCC's ns-3 PFC headroom: this many times rate x link delay (the bytes still
#: in flight when a PAUSE takes effect: the wire both ways plus a frame).
HPCC_HEADROOM_LINK_DELAYS = 3.0

#: The largest buffer a setting may name: 64 GiB is far beyond any switch (a
#: typo guard, not a limit of the model).
MAX_BUFFER_BYTES = 1 << 36


def bdp_bytes(link_gbps: float, rtt_s: float) -> int:
    """Bandwidth-delay product of a path: the bytes in flight at full rate."""
    return int(round(link_gbps * 1e9 / 8 * rtt_s))


def check_bytes(what: str, value: float, *, minimum: float = 0.0,
                maximum: float = MAX_BUFFER_BYTES) -> int:
    """``value`` as a byte count in ``[minimum, maximum]``, or a one-line error."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CongestionConfigError(f"{what}: {value!r} is not a finite number of bytes")
    if value < minimum:
        raise CongestionConfigError(
            f"{what}: {_num(value)} bytes is below the least possible, {_num(minimum)}; "
            "raise it")
    if value > maximum:
        raise CongestionConfigError(
            f"{what}: {_num(value)} bytes is absurd (more than {_num(maximum)}); check the unit")
    return int(value)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"
