"""SwitchCore without processes: forwarding, tree aggregation, source checks,
the job lifecycle table, and the guard that keeps hostile frames harmless."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import NackCode, Op
from fabric.core.topology import leaf_spine, star
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


def test_results_carry_a_crc_only_once_a_node_sends_one() -> None:
    # the switches' hellos always carry a CRC: they must not make every result
    # pay for one in a fabric that cannot corrupt (docs/PROTOCOL.md)
    topo = leaf_spine(2, 2)
    net = Net(topo)
    assert all(c.ready for c in net.cores.values())
    _job(net)
    x = np.arange(1, 38, dtype=np.int32)
    for w in topo.workers:
        _reduce(net, w.name, 1, 0, x)
    for w in topo.workers:
        (res,) = net.take(w.name)
        assert res.op is Op.RESULT and not res.has(fr.Flag.CRC)
    # a member whose driver checks sends CRC frames: from then on the results do too
    for w in topo.workers:
        n, sw = topo.node(w.name), topo.node(topo.switch_of(w.name))
        net.send(w.name, fr.encode_header(Op.REDUCE, src=n.id, dst=sw.id, job=1, psn=1,
                                          dtype=fr.dtype_from_name("int32"), payload=x,
                                          crc=True), x)
    for w in topo.workers:
        (res,) = net.take(w.name)
        assert res.has(fr.Flag.CRC)
        np.testing.assert_array_equal(np.frombuffer(res.payload, np.int32), x * 4)


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


# ---------------------------------------------------------------------- multicast and owners
def _group(net: Net, members: list[str], nth: int = 0) -> int:
    ids = sorted(net.topo.node(m).id for m in members)
    for m in members:
        net.ctrl(m, "group", members=ids, nth=nth)
    gids = set()
    for m in members:
        replies = [control.parse(f.payload) for f in net.take(m)]
        assert replies and replies[-1]["t"] == "group_reply", replies
        gids.add(replies[-1]["gid"])
    (gid,) = gids  # every member learns the same id from the tree root
    assert gid > 0
    return gid


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 2)], ids=["star", "leaf-spine"])
def test_a_multicast_frame_reaches_each_member_once_and_not_its_sender(topo) -> None:
    net = Net(topo)
    names = [w.name for w in topo.workers]
    gid = _group(net, names[1:])  # w0 is not in it
    src = topo.node(names[1])
    body = np.arange(50, dtype=np.uint8)
    net.send(names[1], fr.encode_header(Op.WRITE, src=src.id, dst=gid, flags=fr.Flag.MCAST,
                                        flow=20, payload=body), body)
    got = {n: net.take(n) for n in names}
    assert got[names[0]] == [] and got[names[1]] == []
    for n in names[2:]:
        (f,) = got[n]
        assert f.src == src.id and bytes(f.payload) == body.tobytes()
    copies = sum(c.statistics().mcast_copies for c in net.cores.values())
    # one copy per link the frame must cross: a tree sends it up once, not per member
    assert copies == (2 if len(topo.switches) == 1 else 4)  # leaf->spine->leaf->2 members


def test_a_masked_frame_reaches_the_members_its_block_and_bits_name() -> None:
    """40 members: bit i of the key names member 32 x offset + i (by id); a bit past
    the last member names no one."""
    topo = leaf_spine(5, 8)
    net = Net(topo)
    names = [w.name for w in topo.workers]
    gid = _group(net, names)
    by_id = sorted(names, key=lambda n: topo.node(n).id)
    src = topo.node(by_id[0])
    for key, offset, want in [(0b101, 0, {2}), (1 << 31, 0, {31}), (0b11, 1, {32, 33}),
                              (1 << 7 | 1 << 9, 1, {39})]:
        row = np.frombuffer(b"row", np.uint8)
        net.send(by_id[0], fr.encode_header(Op.WRITE, src=src.id, dst=gid,
                                            flags=fr.Flag.MCAST, flow=22, key=key,
                                            offset=offset, payload=row), row)
        got = {i for i, n in enumerate(by_id) if net.take(n)}
        assert got == want, (key, offset)


def test_multicast_to_an_unknown_group_or_from_a_non_member_is_refused() -> None:
    topo = star(3)
    net = Net(topo)
    gid = _group(net, ["w1", "w2"])
    for sender, dst in (("w0", gid), ("w1", 77)):
        n = topo.node(sender)
        net.send(sender, fr.encode_header(Op.WRITE, src=n.id, dst=dst, flags=fr.Flag.MCAST,
                                          flow=20, payload=b"x"), b"x")
        (nack,) = net.take(sender)
        assert nack.op is Op.NACK
        assert net.take("w1") == [] and net.take("w2") == []


def test_group_ids_are_reused_after_release_and_a_stale_release_is_harmless() -> None:
    net = Net(leaf_spine(2, 2))
    names = [w.name for w in net.topo.workers]
    ids = sorted(net.topo.node(m).id for m in names)
    g1 = _group(net, names, nth=0)
    for m in names:
        net.ctrl(m, "group_release", members=ids, nth=0)
        assert control.parse(net.take(m)[-1].payload)["t"] == "group_released"
    g2 = _group(net, names[:2], nth=0)
    assert g2 == g1  # the freed id is handed out again
    net.ctrl(names[0], "group_release", members=ids, nth=0)  # the old group, again
    net.take(names[0])
    root = net.cores["spine0"]
    assert root.multicast.groups[g2] == tuple(ids[:2])


@pytest.mark.parametrize("topo", [star(3), leaf_spine(2, 2)], ids=["star", "leaf-spine"])
def test_an_owned_job_sends_the_result_to_its_owner_and_completions_to_the_rest(topo) -> None:
    net = Net(topo)
    members = [w.id for w in topo.workers]
    for w in topo.workers:
        net.ctrl(w.name, "job", job=1, members=members, dtype="int32", op="sum", slots=4,
                 slot_elems=64, deliver="owner")
    for w in topo.workers:
        assert control.parse(net.take(w.name)[-1].payload)["granted"]
    owner = topo.workers[-1]
    rng = np.random.default_rng(3)
    xs = {w.name: rng.integers(-99, 99, 33).astype(np.int32) for w in topo.workers}
    for w in topo.workers:
        sw = topo.node(topo.switch_of(w.name))
        net.send(w.name, fr.encode_header(Op.REDUCE, src=w.id, dst=sw.id, job=1, psn=0,
                                          key=owner.id, dtype=fr.dtype_from_name("int32"),
                                          payload=xs[w.name]), xs[w.name])
    for w in topo.workers:
        (res,) = net.take(w.name)
        assert res.op is Op.RESULT
        if w is owner:
            np.testing.assert_array_equal(np.frombuffer(res.payload, np.int32), sum(xs.values()))
        else:
            assert res.length == 0 and res.key == owner.id


def test_an_owned_job_refuses_an_owner_outside_it() -> None:
    net = Net(star(2))
    members = [w.id for w in net.topo.workers]
    for w in net.topo.workers:
        net.ctrl(w.name, "job", job=1, members=members, dtype="int32", op="sum", slots=4,
                 slot_elems=64, deliver="owner")
        net.take(w.name)
    x = np.ones(4, np.int32)
    w0 = net.topo.node("w0")
    net.send("w0", fr.encode_header(Op.REDUCE, src=w0.id, dst=net.topo.node("sw0").id, job=1,
                                    psn=0, key=999, dtype=fr.dtype_from_name("int32"),
                                    payload=x), x)
    (nack,) = net.take("w0")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.INVALID


def test_a_masked_multicast_frame_reaches_only_the_masked_members() -> None:
    net = Net(leaf_spine(2, 2))
    names = [w.name for w in net.topo.workers]
    ids = sorted(net.topo.node(n).id for n in names)
    src = net.topo.node("w0")
    mask = 1 << ids.index(net.topo.node("w3").id)  # one member below the other leaf
    net.send("w0", fr.encode_header(Op.WRITE, src=src.id, dst=0, flags=fr.Flag.MCAST,
                                    flow=22, key=mask, payload=b"tok"),
             np.frombuffer(b"tok", np.uint8))
    got = {n: net.take(n) for n in names}
    assert [len(got[n]) for n in names] == [0, 0, 0, 1]
    assert sum(c.statistics().mcast_copies for c in net.cores.values()) == 3  # up, over, down


def test_a_leaf_sums_one_tokens_partials_and_sends_one_vector_home() -> None:
    """In-network MoE combine: w0 and w1 (one leaf) hold experts of a token of w2."""
    from switchd.core import COMBINE_FLOW

    net = Net(leaf_spine(2, 2))
    home = net.topo.node("w2").id
    # tokens 4 and 7 of w2 in one frame: ids, then one vector each
    parts = {"w0": np.concatenate([np.array([4, 7], np.int32).view(np.float32),
                                   np.full(5, 1.5, np.float32), np.full(5, -1.0, np.float32)]),
             "w1": np.concatenate([np.array([4, 7], np.int32).view(np.float32),
                                   np.full(5, 2.25, np.float32), np.full(5, 0.5, np.float32)])}
    for name, part in parts.items():
        for _ in range(2):  # a resent contribution counts once
            n = net.topo.node(name)
            net.send(name, fr.encode_header(Op.REDUCE, src=n.id, dst=home, flow=COMBINE_FLOW,
                                            job=9, psn=0, key=2, offset=2, msg=1,
                                            dtype=fr.dtype_from_name("float32"),
                                            payload=part), part)
            acks = net.take(name)
            assert acks and acks[-1].op is Op.ACK and acks[-1].key == home
    (got,) = net.take("w2")  # both tokens done by w1's frame: one frame home
    assert got.src == net.topo.node("leaf0").id and got.offset == 2
    body = np.frombuffer(got.payload, np.float32)
    assert body[:2].view(np.int32).tolist() == [4, 7]
    np.testing.assert_array_equal(body[2:7], np.full(5, 3.75))
    np.testing.assert_array_equal(body[7:], np.full(5, -0.5))
    # the home lost it: it asks the leaf, which kept the sum
    net.send("w2", fr.encode_nack(src=home, dst=net.topo.node("leaf0").id, flow=COMBINE_FLOW,
                                  psn=4, code=NackCode.MISSING, job=9, msg=1))
    (again,) = net.take("w2")
    assert again.offset == 1
    np.testing.assert_array_equal(np.frombuffer(again.payload, np.float32)[1:], np.full(5, 3.75))
    # the frame came trimmed (a header alone): its first token names it, and the
    # leaf sends the whole frame again
    net.send("w2", fr.encode_nack(src=home, dst=net.topo.node("leaf0").id, flow=COMBINE_FLOW,
                                  psn=4, code=NackCode.TRIMMED, job=9, msg=1))
    (whole,) = net.take("w2")
    assert whole.offset == 2 and bytes(whole.payload) == bytes(got.payload)
    # a NACK naming no frame sent brings nothing
    net.send("w2", fr.encode_nack(src=home, dst=net.topo.node("leaf0").id, flow=COMBINE_FLOW,
                                  psn=7, code=NackCode.TRIMMED, job=9, msg=1))
    assert net.take("w2") == []
    assert net.cores["leaf0"].statistics().services["combine"].resent == 2


def test_results_carry_the_mark_below_which_every_chunk_is_complete() -> None:
    # members can tell "my result was lost" (chunk below the mark) from "another
    # member's contribution is missing" (at or above it) without resending
    net = Net(star(2))
    _job(net, job=4)
    x = np.arange(4, dtype=np.int32)
    _reduce(net, "w0", 4, 0, x)
    _reduce(net, "w0", 4, 1, x)
    _reduce(net, "w1", 4, 1, x)  # chunk 1 completes, chunk 0 waits for w1
    (r1,) = [f for f in net.take("w0") if f.op is Op.RESULT]
    assert r1.psn == 1 and r1.offset == 0  # nothing complete below 0
    _reduce(net, "w1", 4, 0, x)
    (r0,) = [f for f in net.take("w0") if f.op is Op.RESULT]
    assert r0.psn == 0 and r0.offset == 2  # 0 and 1 complete


def test_each_member_gets_its_own_mark() -> None:
    # chunk 0 holds w0's contribution and waits for w1's (lost on the way); chunk
    # 1 completes. To w0 the mark stays at 0: its missing result for 0 is not
    # lost, it waits. To w1 it passes 0: below it, w1's own contribution is what
    # is missing, so w1 resends chunk 0 when later results overtake it.
    net = Net(star(2))
    _job(net, job=5)
    x = np.arange(4, dtype=np.int32)
    _reduce(net, "w0", 5, 0, x)
    _reduce(net, "w0", 5, 1, x)
    _reduce(net, "w1", 5, 1, x)
    (to_w0,) = [f for f in net.take("w0") if f.op is Op.RESULT]
    (to_w1,) = [f for f in net.take("w1") if f.op is Op.RESULT]
    assert to_w0.psn == to_w1.psn == 1
    assert to_w0.offset == 0 and to_w1.offset == 2
    _reduce(net, "w1", 5, 0, x)  # w1's resend completes chunk 0
    marks = {n: [f.offset for f in net.take(n) if f.op is Op.RESULT] for n in ("w0", "w1")}
    assert marks == {"w0": [2], "w1": [2]}


@pytest.mark.parametrize("topo", [star(3), leaf_spine(2, 2)], ids=["star", "leaf-spine"])
def test_a_marked_contribution_marks_the_chunk_for_every_member(topo) -> None:
    """One member's contribution came congestion experienced: the chunk's result
    reaches every member marked (up the tree in the partial, down in the results),
    so every member's policy hears of it; the next chunk, unmarked, is not."""
    from fabric.core.frame import Flag

    net = Net(topo)
    _job(net)
    last = topo.workers[-1]
    for psn in (0, 1):
        for w in topo.workers:
            x = np.arange(8, dtype=np.int32)
            sw = topo.node(topo.switch_of(w.name))
            flags = Flag.ECN if (w is last and psn == 0) else Flag.NONE
            net.send(w.name, fr.encode_header(Op.REDUCE, src=w.id, dst=sw.id, job=1, psn=psn,
                                              dtype=fr.dtype_from_name("int32"), payload=x,
                                              flags=flags), x)
    for w in topo.workers:
        got = {f.psn: f.has(Flag.ECN) for f in net.take(w.name) if f.op is Op.RESULT}
        assert got == {0: True, 1: False}, w.name
