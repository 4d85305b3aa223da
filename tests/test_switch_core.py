"""SwitchCore without processes: forwarding, tree aggregation, source checks,
the job lifecycle table, and the guard that keeps hostile frames harmless."""

from __future__ import annotations

import numpy as np
import pytest

from fabric import control
from fabric import frame as fr
from fabric.frame import NackCode, Op
from fabric.topology import leaf_spine, star
from switchd.core import JOB_TRANSITIONS, JobPhase, SwitchCore


class Net:
    """Switch cores of one topology wired together in memory (no links)."""

    def __init__(self, topo) -> None:
        self.topo = topo
        self.cores = {s.name: SwitchCore(topo, s.name) for s in topo.switches}
        self.inbox: dict[str, list[fr.Frame]] = {n.name: [] for n in topo.nodes}
        for c in self.cores.values():
            self.deliver(c.name, c.handle_timer(0.0))

    def deliver(self, frm: str, outs) -> None:
        for port, header, payload in outs:
            to = port.decode()
            if to in self.cores:
                self.deliver(to, self.cores[to].handle(frm.encode(), header, payload, 0.0))
            else:
                body = None if payload is None else memoryview(np.asarray(payload).view(np.uint8))
                self.inbox[to].append(fr.decode(header, body))

    def send(self, node: str, header: bytes, payload=None, port: str | None = None) -> None:
        sw = self.topo.switch_of(node)
        self.deliver(sw, self.cores[sw].handle((port or node).encode(), header, payload, 0.0))

    def ctrl(self, node: str, t: str, **fields) -> None:
        sw = self.topo.switch_of(node)
        self.send(node, fr.encode(Op.CTRL, src=self.topo.node(node).id,
                                  dst=self.topo.node(sw).id, payload=control.pack(t, **fields)))

    def take(self, node: str) -> list[fr.Frame]:
        out, self.inbox[node] = self.inbox[node], []
        return out


def _job(net: Net, job: int = 1, dtype: str = "int32") -> None:
    members = [w.id for w in net.topo.workers]
    for w in net.topo.workers:
        net.ctrl(w.name, "job", job=job, members=members, dtype=dtype, op="sum", slots=4,
                 slot_elems=64)
    for w in net.topo.workers:
        replies = [control.parse(f.payload) for f in net.take(w.name)]
        assert replies and all(r["granted"] for r in replies), replies


def _reduce(net: Net, node: str, job: int, psn: int, x: np.ndarray, src: int | None = None,
            port: str | None = None) -> None:
    n = net.topo.node(node)
    sw = net.topo.node(net.topo.switch_of(node))
    net.send(node, fr.encode_header(Op.REDUCE, src=n.id if src is None else src, dst=sw.id,
                                    job=job, psn=psn, dtype=fr.dtype_from_name("int32"),
                                    payload=x), x, port=port)


@pytest.mark.parametrize("topo", [star(3), leaf_spine(2, 2)], ids=["star", "leaf-spine"])
def test_allreduce_through_the_cores_is_exact(topo) -> None:
    net = Net(topo)
    assert all(c.ready for c in net.cores.values())
    _job(net)
    rng = np.random.default_rng(7)
    xs = {w.name: rng.integers(-1000, 1000, 37).astype(np.int32) for w in topo.workers}
    for w in topo.workers:
        _reduce(net, w.name, 1, 0, xs[w.name])
    want = sum(xs.values())
    for w in topo.workers:
        (res,) = net.take(w.name)
        assert res.op is Op.RESULT
        np.testing.assert_array_equal(np.frombuffer(res.payload, np.int32), want)


def test_a_node_cannot_speak_for_another() -> None:
    topo = star(2)
    net = Net(topo)
    _job(net)
    w0, w1 = topo.workers
    # w0's port, w1's id: refused, nothing counted for w1
    _reduce(net, "w0", 1, 0, np.ones(8, np.int32), src=w1.id)
    (nack,) = net.take("w0")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.PERMISSION
    core = net.cores[topo.switch_of("w0")]
    assert core.statistics().unauthorised == 1
    assert core.statistics().engine.contributions == 0


def test_hostile_frames_never_raise_and_the_next_allreduce_is_exact() -> None:
    topo = star(2)
    net = Net(topo)
    core = net.cores[topo.switch_of("w0")]
    rng = np.random.default_rng(3)
    good = fr.encode(Op.CTRL, src=0, dst=core.id, payload=control.pack("job", job=9))
    for i in range(3000):
        blob = bytearray(good if i % 2 else rng.bytes(int(rng.integers(0, 80))))
        for _ in range(int(rng.integers(0, 4))):
            if blob:
                blob[int(rng.integers(0, len(blob)))] = int(rng.integers(0, 256))
        core.handle(b"w0", bytes(blob), None, 0.0)  # must not raise
    hostile = [
        control.pack("job", job=2, members=[999], dtype="int32", op="sum", slots=1,
                     slot_elems=4),
        control.pack("job", job=2, members=[0, 1], dtype="int32", op="sum", slots=1,
                     slot_elems=4, referenced=True, backend="no-such"),
        control.pack("region", key=5, size=-3, path="/nonexistent"),
        control.pack("barrier", id=1, n=10**9),
        control.pack("release", job="x"),
    ]
    for payload in hostile:
        core.handle(b"w0", fr.encode(Op.CTRL, src=0, dst=core.id, payload=payload), None, 0.0)
    net.take("w0")
    net.take("w1")
    _job(net, job=3)
    for w in topo.workers:
        _reduce(net, w.name, 3, 0, np.arange(16, dtype=np.int32))
    for w in topo.workers:
        res = [f for f in net.take(w.name) if f.op is Op.RESULT]
        np.testing.assert_array_equal(np.frombuffer(res[0].payload, np.int32),
                                      2 * np.arange(16))


def test_only_members_release_a_job_and_release_frees_it() -> None:
    topo = star(3)
    members = [topo.node("w0").id, topo.node("w1").id]
    net = Net(topo)
    for w in ("w0", "w1"):
        net.ctrl(w, "job", job=4, members=members, dtype="int32", op="sum", slots=2,
                 slot_elems=8)
    core = net.cores[topo.switch_of("w0")]
    assert core.job_phase(4) is JobPhase.GRANTED
    net.ctrl("w2", "release", job=4)  # not a member
    assert core.job_phase(4) is JobPhase.GRANTED
    (nack,) = [f for f in net.take("w2") if f.op is Op.NACK]
    assert nack.nack_code is NackCode.PERMISSION
    net.ctrl("w0", "release", job=4)
    assert core.job_phase(4) is JobPhase.RELEASED
    assert core.statistics().engine.jobs == 0


def test_tree_job_waits_for_the_parent_then_is_granted() -> None:
    topo = leaf_spine(2, 2)
    net = Net(topo)
    _job(net, job=5)
    phases = {name: c.job_phase(5) for name, c in net.cores.items()}
    assert set(phases.values()) == {JobPhase.GRANTED}


def test_every_transition_leads_to_a_phase() -> None:
    assert all(isinstance(v, JobPhase) for v in JOB_TRANSITIONS.values())
    assert (JobPhase.RELEASED, "parent_grant") not in JOB_TRANSITIONS
