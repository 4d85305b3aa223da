"""Semantic distance: how many times data is re-handled between producer and consumer.

DESIGN.md §1.2. Each path increments these counters at the place in the code
where the step really happens, so a benchmark can say "host-ps costs 7 copies,
4 encodes and 4 process crossings per chunk; ina-mem costs 1 copy".

Definitions (per chunk of payload, from the producing worker to the result in
its memory):

* ``copies``: the chunk's bytes written into another buffer by user-space code
  (a staging copy, a receive into a destination buffer, a reduction into switch
  memory, a store of the result into a region).
* ``encodes``: the payload serialised or parsed (msgpack pack or unpack).
  Fixed frame headers are not counted: they do not touch the payload.
* ``crossings``: the payload handed from one process to another through a
  socket. Memory-plane accesses through a shared mapping are not crossings:
  they stand for a device reading another device's memory over the fabric.
* ``hops``: switch traversals of the payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass
class SemanticCounts:
    """Running totals; divide by ``chunks`` for per-chunk figures."""

    copies: float = 0.0
    encodes: float = 0.0
    crossings: float = 0.0
    hops: float = 0.0
    chunks: int = 0

    def add(self, other: SemanticCounts) -> None:
        """Add another set of totals into this one."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: SemanticCounts) -> SemanticCounts:
        """The difference (for before/after snapshots)."""
        return SemanticCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(self))
        )

    def copy(self) -> SemanticCounts:
        """A snapshot."""
        return SemanticCounts(*(getattr(self, f.name) for f in fields(self)))

    def per_chunk(self) -> dict[str, float]:
        """copies/encodes/crossings/hops per chunk (0 chunks gives zeros)."""
        n = self.chunks or 1
        return {
            "copies": self.copies / n,
            "encodes": self.encodes / n,
            "crossings": self.crossings / n,
            "hops": self.hops / n,
        }


@dataclass(frozen=True)
class ClassTraffic:
    """What one network class's links carried, both directions: bytes, frames (each
    a hand-over from one node to the next: a process crossing on launched
    processes) and, of those, the frames that entered a switch (hops)."""

    bytes: int = 0
    frames: int = 0
    hops: int = 0


def class_traffic(directions: Iterable[tuple[str, bool, int, int]]) -> dict[str, ClassTraffic]:
    """Totals per network class from each link direction's ``(class, into a switch,
    bytes, frames)``: the one place both drivers count a fabric's classes."""
    out: dict[str, ClassTraffic] = {}
    for cls, into_switch, nbytes, frames in directions:
        t = out.get(cls, ClassTraffic())
        out[cls] = ClassTraffic(t.bytes + nbytes, t.frames + frames,
                                t.hops + (frames if into_switch else 0))
    return out
