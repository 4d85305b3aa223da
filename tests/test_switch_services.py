"""In-network services added to a switch: the toy sequencer in both worlds, and
how the forwarding core offers frames and control messages to services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import NackCode, Op
from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.errors import UsageError
from fabric.sim import Simulation
from switchd.core import Service, SwitchContext, SwitchCore
from switchd.plugins import load_service

SEQUENCER = str(Path(__file__).resolve().parents[1] / "examples/services/sequencer.py")
SPEC = f"{SEQUENCER}:Sequencer"


def _numbers() -> Any:
    sequencer = load_service(SPEC)
    return sequencer, __import__(sequencer.__module__).numbers


def _check_order(results: list[Any], count: int) -> None:
    shared = sorted(n for mine, _ in results for n in mine)
    assert shared == list(range(count * len(results)))  # each number once, none skipped
    for mine, own in results:
        assert mine == sorted(mine)  # one worker's requests are answered in order
        assert own == 0  # its own stream starts at 0


@pytest.mark.parametrize("faults", [None, "loss=0.2"])
def test_sequencer_in_simulation(faults: str | None) -> None:
    sequencer, numbers = _numbers()
    sim = Simulation(star(4), services=[sequencer], faults=faults, seed=3)
    res = sim.run(numbers, 6)
    _check_order(res.results, 6)
    stats = sim.switches["sw0"].statistics().services["sequencer"]
    # lost requests and replies were resent; each request still got one number
    assert (stats.streams, stats.handed_out) == (5, 4 * 7)


@pytest.mark.timeout(90)
def test_sequencer_in_emulation(tmp_path: Path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=20, switch_services=[SPEC]) as fab:
        # the workload is the same generator the simulation ran (sequencer.numbers)
        results = fab.run_ref("semfab_user_script", "emulated", SEQUENCER, [4])
        stats = fab.switch_stats()["sw0"]["services"]["sequencer"]
    _check_order(results, 4)
    assert stats == {"streams": 4, "handed_out": 3 * 5}


def test_a_bad_service_name_is_one_usage_error() -> None:
    with pytest.raises(UsageError, match="module:Class"):
        load_service("no-colon")
    with pytest.raises(UsageError, match="cannot import"):
        load_service("no_such_module_here:X")
    with pytest.raises(UsageError, match="not a subclass"):
        load_service(f"{SEQUENCER}:numbers")


class _WriteTap(Service):
    """Counts WRITE bytes passing to workers and lets them through (claims none)."""

    name = "tap"
    ops = (Op.WRITE,)

    def __init__(self, ctx: SwitchContext) -> None:
        super().__init__(ctx)
        self.seen = 0

    def claims(self, f: fr.Frame, port: bytes, speaker: int | None) -> bool:
        self.seen += f.length
        return False

    def statistics(self) -> dict[str, int]:
        return {"bytes": self.seen}


class _Echo(Service):
    """Takes WRITE frames addressed to the switch and answers with a control message."""

    name = "echo"
    ops = (Op.WRITE,)

    def handle(self, f: fr.Frame, port: bytes, header: Any, payload: Any, now: float) -> None:
        self.ctx.ctrl(port, f.src, "echo", n=f.length)


def test_services_see_frames_by_opcode_before_forwarding() -> None:
    topo = star(2)
    core = SwitchCore(topo, "sw0", services=[_WriteTap, _Echo])
    w0, w1 = topo.node("w0"), topo.node("w1")
    body = bytes(range(37))
    out = core.handle(b"w0", fr.encode_header(Op.WRITE, src=w0.id, dst=w1.id, payload=body),
                      body, 0.0)
    assert [p for p, _h, _b in out] == [b"w1"]  # passed through to w1, untouched
    out = core.handle(b"w0", fr.encode_header(Op.WRITE, src=w0.id, dst=core.id, payload=body),
                      body, 0.0)
    (port, header, _), = out
    assert port == b"w0"
    assert control.parse(fr.decode(header).payload) == {"t": "echo", "n": 37}
    st = core.statistics()
    assert st.services["tap"] == {"bytes": 74} and st.forwarded == 1


class _Broken(Service):
    name = "broken"
    ctrl_types = ("boom",)

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        raise RuntimeError("a bug in a service")


def test_a_failing_service_is_counted_and_nacked_and_the_switch_goes_on() -> None:
    topo = star(2)
    core = SwitchCore(topo, "sw0", services=[_Broken])
    w0 = topo.node("w0")
    out = core.handle(b"w0", fr.encode(Op.CTRL, src=w0.id, dst=core.id,
                                       payload=control.pack("boom")), None, 0.0)
    (_, header, _), = out
    nack = fr.decode(header)
    assert nack.op is Op.NACK and nack.offset == NackCode.MALFORMED
    assert core.statistics().malformed == 1
    out = core.handle(b"w0", fr.encode(Op.CTRL, src=w0.id, dst=core.id,
                                       payload=control.pack("stats")), None, 0.0)
    assert control.parse(fr.decode(out[0][1]).payload)["t"] == "stats"


def test_two_services_cannot_answer_one_control_type() -> None:
    class Clash(Service):
        name = "clash"
        ctrl_types = ("barrier",)

    with pytest.raises(ValueError, match="'barrier' of service 'clash' is taken by barriers"):
        SwitchCore(star(2), "sw0", services=[Clash])


def test_barriers_remember_the_last_ones_done_and_forget_the_oldest() -> None:
    """A barrier arrival repeated after it completed is answered at once (its reply
    was lost); the service keeps the last BARRIERS_KEPT such barriers only."""
    from switchd.core.barriers import BARRIERS_KEPT

    topo = star(2)
    sw = topo.switches[0]
    core = SwitchCore(topo, sw.name)
    core.handle_timer(0.0)

    def arrive(worker: str, bid: int) -> list[Any]:
        node = topo.node(worker)
        frame = fr.encode(Op.CTRL, src=node.id, dst=sw.id,
                          payload=control.pack("barrier", id=bid, n=2))
        return core.handle(worker.encode(), frame, None, 1.0)

    for bid in range(1, BARRIERS_KEPT + 6):
        assert arrive("w0", bid) == []
        assert len(arrive("w1", bid)) == 2  # both answered
    assert len(arrive("w0", BARRIERS_KEPT + 5)) == 1  # done: answered again at once
    assert arrive("w0", 5) == []  # forgotten: it waits for the others again
