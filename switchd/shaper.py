"""Link shaping: when a frame may be delivered over an emulated link (pure).

One :class:`LinkShaper` per link direction. A frame of ``n`` bytes entering a
link at ``now`` starts when the link is free, occupies it for its
serialisation time at the link bandwidth, and arrives ``latency`` later:
the store-and-forward model of one switch port. Deliveries on one link are
never reordered, since its departure times never decrease.
"""

from __future__ import annotations

from fabric.topology import LinkParams


class LinkShaper:
    """Serialisation + propagation delay of one link direction (seconds)."""

    def __init__(self, params: LinkParams) -> None:
        self.params = params
        self._free_at = 0.0
        self.frames = 0
        self.bytes = 0
        self.busy_s = 0.0

    @property
    def active(self) -> bool:
        """False when the link adds neither delay nor a bandwidth limit."""
        return self.params.shaped or self.params.latency_us > 0

    def schedule(self, nbytes: int, now: float) -> float:
        """Deliver time of ``nbytes`` entering the link at ``now``."""
        start = max(now, self._free_at)
        wire = self.params.serialization_us(nbytes) / 1e6
        self._free_at = start + wire
        self.frames += 1
        self.bytes += nbytes
        self.busy_s += wire
        return self._free_at + self.params.latency_us / 1e6

    def backlog_s(self, now: float) -> float:
        """How long a frame entering now would wait for the link to be free."""
        return max(self._free_at - now, 0.0)
