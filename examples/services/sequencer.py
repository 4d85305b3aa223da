"""A toy in-network service: a sequencer in the switch.

Each ``seq`` control message gets the next number of its stream, so the
workers below one switch agree on an order without talking to each other (the
idea behind in-network sequencers such as NOPaxos's). A request resent after a
lost reply gets the number it was given the first time: exactly once.

Add it to every switch, in either world::

    semfab launch --workers 4 --switch-service examples/services/sequencer.py:Sequencer \\
        --run examples/services/sequencer.py:emulated
    Simulation(star(4), services=["examples/services/sequencer.py:Sequencer"])

and ask it from a workload with ``n = (yield ctx.control("seq", "seq_reply",
stream=0))["n"]``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fabric.core import frame as fr
from switchd.core import Service, SwitchContext

#: Answers remembered for resent requests (oldest forgotten first).
ANSWERS_KEPT = 4096


@dataclass(frozen=True)
class SequencerStats:
    """Streams seen and numbers handed out (resends not counted)."""

    streams: int
    handed_out: int


class Sequencer(Service):
    """``seq`` {stream} -> ``seq_reply`` {stream, n}: n = 0, 1, 2, ... per stream."""

    name = "sequencer"
    ctrl_types = ("seq",)

    def __init__(self, ctx: SwitchContext) -> None:
        super().__init__(ctx)
        self.next: dict[int, int] = {}
        # (node, request id) -> (stream, n): a resend gets the same answer
        self.answers: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()
        self.handed_out = 0

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        stream = msg.get("stream")
        if not isinstance(stream, int) or stream < 0:
            raise ValueError(f"seq needs a stream number >= 0, got {stream!r}")  # NACKed
        answer = self.answers.get((f.src, f.msg))
        if answer is None or answer[0] != stream:
            answer = (stream, self.next.get(stream, 0))
            self.next[stream] = answer[1] + 1
            self.handed_out += 1
            self.answers[(f.src, f.msg)] = answer
            if len(self.answers) > ANSWERS_KEPT:
                self.answers.popitem(last=False)
        self.ctx.ctrl(port, f.src, "seq_reply", stream=stream, n=answer[1])

    def statistics(self) -> SequencerStats:
        return SequencerStats(streams=len(self.next), handed_out=self.handed_out)


def numbers(ctx: Any, count: int = 5) -> Any:
    """A workload (both worlds): ``count`` numbers of stream 0, then of stream rank+1."""
    mine = []
    for _ in range(count):
        reply = yield ctx.control("seq", "seq_reply", stream=0)
        mine.append(reply["n"])
    own = yield ctx.control("seq", "seq_reply", stream=ctx.rank + 1)
    return mine, own["n"]


def emulated(ep: Any, count: int = 5) -> Any:
    """``numbers`` on a launched worker (``semfab launch --run``)."""
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, numbers, count)
