"""In-network and host state belongs to one incarnation of one group (issue 25, part 1).

A group made again with the same members, a chunk that names other members, a
barrier of a group the sender does not hold or that was released, another
tenant's MoE partials, a tenant that asks for every group id: each is refused
or kept apart, never summed into someone else's result. Both worlds where the
example applies; the switch core and the host aggregator alone for the frames
a well-behaved worker never sends.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, NackCode, Op
from fabric.core.hostnode import HostAggregator
from fabric.core.topology import Topology, leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from switchd.core import COMBINE_FLOW
from switchd.core.multicast import MAX_GROUPS
from tests import fabric_tasks as tasks
from tests.test_switch_core import Net, _group

N = 1001  # odd: chunks and segments do not divide it evenly


# ----------------------------------------------------------- a group made again
def reopen_workload(ctx, rounds: int):
    """The same ranks make, use and close a communicator ``rounds`` times; each
    round's inputs differ, so a result of an earlier incarnation shows."""
    out = []
    for rnd in range(rounds):
        g = yield ctx.group([0, 1])
        x = tasks.coll_input(ctx.rank, rnd, N, "int32")
        got = {}
        for path in ("host-ps", "host-ring", "ina"):
            got[path] = np.array((yield ctx.allreduce(x.copy(), path=path, group=g)))
        got["all_gather"] = np.array((yield ctx.all_gather(x, group=g)))
        got["alltoall"] = np.array((yield ctx.alltoall(x[:1000], group=g)))
        yield ctx.close_group(g)
        out.append(got)
    return out


def _check_reopen(results, rounds: int) -> None:
    for rank in (0, 1):
        for rnd, got in enumerate(results[rank]):
            xs = [tasks.coll_input(r, rnd, N, "int32") for r in (0, 1)]
            for path in ("host-ps", "host-ring", "ina"):
                np.testing.assert_array_equal(got[path], xs[0] + xs[1], err_msg=f"{path} {rnd}")
            np.testing.assert_array_equal(got["all_gather"], np.concatenate(xs))
            mine = [x[:1000].reshape(2, 500)[rank] for x in xs]
            np.testing.assert_array_equal(got["alltoall"], np.concatenate(mine))
        assert len(results[rank]) == rounds


def reopen_task(ep, rounds: int):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, reopen_workload, rounds)


def test_a_group_made_again_starts_clean_in_simulation() -> None:
    res = Simulation(star(2, hosts=1), seed=3).run(reopen_workload, 3)
    _check_reopen(res.results, 3)


def test_a_group_made_again_starts_clean_in_emulation(tmp_path) -> None:
    with launch(topology=star(2, hosts=1), run_dir=tmp_path, timeout_s=30) as fab:
        res = fab.run(reopen_task, 3)
    _check_reopen(res, 3)


def test_each_incarnation_gets_its_own_unpredictable_id() -> None:
    net = Net(star(3))
    ids = sorted(net.topo.node(m).id for m in ("w0", "w1"))
    incs = []
    for nth in range(3):
        for m in ("w0", "w1"):
            net.ctrl(m, "group", members=ids, nth=nth)
        replies = [control.parse(f.payload) for m in ("w0", "w1") for f in net.take(m)]
        assert len({r["inc"] for r in replies}) == 1  # every member learns the same
        incs.append(replies[0]["inc"])
        for m in ("w0", "w1"):
            net.ctrl(m, "group_release", members=ids, nth=nth)
            net.take(m)
    assert len(set(incs)) == 3 and all(i > 0 for i in incs)
    assert max(incs) > 1 << 32  # drawn from 63 bits, not a counter


# ----------------------------------------------------------- the host aggregator
def _chunk(src_members, seq, data, inc=7, chunk=0):
    return msgpack.packb({"seq": seq, "inc": inc, "chunk": chunk, "members": src_members,
                          "op": "sum", "dtype": "int32",
                          "data": np.asarray(data, np.int32).tobytes()})


def test_a_chunk_naming_other_members_never_enters_the_groups_sum() -> None:
    host = HostAggregator()
    rng = np.random.default_rng(5)
    a, b = rng.integers(-50, 50, 33), rng.integers(-50, 50, 33)
    # node 9 gets in first, naming the group's members and itself
    assert host.on_message(9, _chunk([0, 1, 9], 1, np.full(33, 777))) == []
    # ... and a guess of the incarnation with the right members is refused: not a member
    with pytest.raises(FrameError) as exc:
        host.on_message(9, _chunk([0, 1], 1, np.full(33, 777)))
    assert exc.value.code is NackCode.PERMISSION
    assert host.on_message(0, _chunk([0, 1], 1, a)) == []
    replies = host.on_message(1, _chunk([0, 1], 1, b))
    assert sorted(d for d, _ in replies) == [0, 1]
    got = np.frombuffer(msgpack.unpackb(replies[0][1])["data"], np.int32)
    np.testing.assert_array_equal(got, a + b)


def test_a_new_incarnation_is_never_answered_from_an_old_ones_replies() -> None:
    host = HostAggregator()
    rng = np.random.default_rng(6)
    old = [rng.integers(-9, 9, 17) for _ in range(2)]
    new = [rng.integers(-9, 9, 17) for _ in range(2)]
    for r in (0, 1):
        host.on_message(r, _chunk([0, 1], 1, old[r], inc=111))
    # same members, same call and chunk numbers, another incarnation
    assert host.on_message(0, _chunk([0, 1], 1, new[0], inc=222)) == []
    replies = host.on_message(1, _chunk([0, 1], 1, new[1], inc=222))
    got = np.frombuffer(msgpack.unpackb(replies[0][1])["data"], np.int32)
    np.testing.assert_array_equal(got, new[0] + new[1])


# ----------------------------------------------------------- barriers
def _barrier(net: Net, node: str, bid: int, n: int, inc: int) -> fr.Frame:
    net.ctrl(node, "barrier", id=bid, n=n, inc=inc)
    (f,) = net.take(node)
    return f


def test_a_barrier_of_a_group_the_sender_does_not_hold_is_refused() -> None:
    net = Net(star(4))
    for gid in (5, 200):  # no such group
        f = _barrier(net, "w0", gid << 32 | 1, 1, 0)
        assert f.op is Op.NACK and f.nack_code is NackCode.PERMISSION


def test_a_released_groups_barrier_never_passes_for_the_next_group_with_its_id() -> None:
    net = Net(star(4))
    names = ["w0", "w1"]
    ids = sorted(net.topo.node(m).id for m in names)
    gid = _group(net, names)
    inc1 = net.cores["sw0"].multicast.incarnations[gid]
    net.ctrl("w0", "barrier", id=gid << 32 | 1, n=2, inc=inc1)
    done = _barrier(net, "w1", gid << 32 | 1, 2, inc1)
    assert control.parse(done.payload)["t"] == "barrier_done"
    net.take("w0")
    net.ctrl("w0", "barrier", id=gid << 32 | 2, n=2, inc=inc1)  # w0 waits in barrier 2
    assert net.take("w0") == []
    for m in names:
        net.ctrl(m, "group_release", members=ids, nth=0)
        net.take(m)
    assert net.cores["sw0"].statistics().services["barriers"].waiting == 0  # wiped
    # a late retry of the finished barrier is still answered
    again = _barrier(net, "w1", gid << 32 | 1, 2, inc1)
    assert control.parse(again.payload)["t"] == "barrier_done"
    # the next group gets the same id; the old incarnation's barrier is refused...
    assert _group(net, names, nth=1) == gid
    inc2 = net.cores["sw0"].multicast.incarnations[gid]
    assert inc2 != inc1
    stale = _barrier(net, "w0", gid << 32 | 2, 2, inc1)
    assert stale.op is Op.NACK and stale.nack_code is NackCode.PERMISSION
    # ... and the new one waits for both members
    net.ctrl("w0", "barrier", id=gid << 32 | 1, n=2, inc=inc2)
    assert net.take("w0") == []
    assert control.parse(_barrier(net, "w1", gid << 32 | 1, 2, inc2).payload)["t"] \
        == "barrier_done"


# ----------------------------------------------------------- MoE combine
def _combine_part(net: Net, name: str, home: int, msg: int, value: float) -> None:
    """``name``'s MoE combine partial for token 3 of ``home`` (4 floats of
    ``value``; stream 2, two contributions expected)."""
    body = np.concatenate([np.array([3], np.int32).view(np.float32),
                           np.full(4, value, np.float32)])
    net.send(name, fr.encode_header(Op.REDUCE, src=net.topo.node(name).id, dst=home,
                                    flow=COMBINE_FLOW, job=2, psn=0, key=2, offset=1, msg=msg,
                                    dtype=fr.dtype_from_name("float32"), payload=body), body)


def test_another_tenants_combine_partials_never_enter_a_sum() -> None:
    topo = tasks.tenant_topology(2)  # a: w0 w1, b: w2 w3; one switch
    net = Net(topo)
    home = topo.node("w1").id

    def part(name: str, value: float) -> None:
        _combine_part(net, name, home, 5, value)

    part("w2", 777.0)  # tenant b, the victim's message and stream ids
    (nack,) = net.take("w2")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.PERMISSION
    part("w0", 1.5)
    part("w1", 2.0)
    (got,) = net.take("w1")[-1:]
    np.testing.assert_array_equal(np.frombuffer(got.payload, np.float32)[1:], np.full(4, 3.5))
    assert net.cores["sw0"].statistics().unauthorised >= 1


def test_a_non_member_of_the_same_tenant_never_enters_a_groups_combine() -> None:
    """w0 and w1 make a communicator; w2 (another group, same star) names its
    message ids (group id in the top bits): refused, the members' sum exact."""
    from fabric.core.programs import GROUP_MSG_BITS

    topo = star(3)
    net = Net(topo)
    ids = sorted(topo.node(m).id for m in ("w0", "w1"))
    for name in ("w0", "w1"):
        net.ctrl(name, "group", members=ids, nth=0)
    gid = control.parse(net.take("w1")[-1].payload)["gid"]
    home = topo.node("w1").id
    msg = gid << GROUP_MSG_BITS | 9

    def part(name: str, value: float) -> None:
        _combine_part(net, name, home, msg, value)

    net.take("w0")
    part("w2", 777.0)  # not a member of the group
    (nack,) = net.take("w2")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.PERMISSION
    part("w0", 1.5)
    part("w1", 2.0)
    (got,) = net.take("w1")[-1:]
    np.testing.assert_array_equal(np.frombuffer(got.payload, np.float32)[1:], np.full(4, 3.5))


# ----------------------------------------------------------- group ids per tenant
def _ask_groups(net: Net, name: str, partner: str, count: int) -> list[dict]:
    ids = sorted(net.topo.node(m).id for m in (name, partner))
    replies = []
    for nth in range(count):
        net.ctrl(name, "group", members=ids, nth=nth)
        replies.append(control.parse(net.take(name)[-1].payload))
    return replies


def test_no_tenant_can_take_every_group_id() -> None:
    net = Net(tasks.tenant_topology(2))
    share = MAX_GROUPS // 2
    a = _ask_groups(net, "w0", "w1", share + 3)
    assert all(r["gid"] > 0 for r in a[:share])
    assert all(r["gid"] == -1 and "quota of 127" in r["reason"] for r in a[share:])
    b = _ask_groups(net, "w2", "w3", 2)  # the other tenant still gets groups
    assert all(r["gid"] > 0 for r in b)
    stats = net.cores["sw0"].statistics().services["multicast"]
    assert stats.by_tenant == {"a": share, "b": 2} and stats.refused == 3


def test_a_group_quota_from_the_topology_file_and_a_group_across_tenants() -> None:
    d = tasks.tenant_topology(2).to_dict()
    d["tenants"]["a"]["groups"] = 2
    topo = Topology.from_dict(d)
    assert Topology.from_dict(topo.to_dict()).tenants["a"].groups == 2
    net = Net(topo)
    a = _ask_groups(net, "w0", "w1", 3)
    assert [r["gid"] > 0 for r in a] == [True, True, False]
    assert "tenant 'a' holds 2 groups, its quota of 2" in a[2]["reason"]
    cross = _ask_groups(net, "w1", "w2", 1)[0]
    assert cross["gid"] == -1 and "share one tenant" in cross["reason"]


def group_quota_workload(ctx, groups: int):
    """Tenant a's two workers make ``groups`` groups and keep them; tenant b then
    makes one and reduces in it."""
    if ctx.rank < 2:
        for _ in range(groups):
            yield ctx.group([0, 1])
        return {"made": groups}
    yield ctx.compute(0.5)  # after tenant a took its share
    g = yield ctx.group([2, 3])
    y = yield ctx.allreduce(np.arange(5, dtype=np.int32) + ctx.rank, path="ina", group=g)
    return {"sum": np.array(y).tolist()}


def test_group_quota_in_simulation() -> None:
    from fabric.sim.engine import SimulationError

    d = tasks.tenant_topology(2).to_dict()
    d["tenants"]["a"]["groups"] = 3
    res = Simulation(Topology.from_dict(d)).run(group_quota_workload, 3)
    assert res.results[2]["sum"] == (2 * np.arange(5) + 5).tolist()
    with pytest.raises(SimulationError, match="tenant 'a' holds 3 groups, its quota of 3"):
        Simulation(Topology.from_dict(d)).run(group_quota_workload, 4)


# ----------------------------------------------------------- one rank's mistake
def order_workload(ctx):
    """Rank 1 passes the group's ranks in another order than the others."""
    ranks = list(range(ctx.world))
    g = yield ctx.group(ranks if ctx.rank != 1 else ranks[::-1])
    return g


@pytest.mark.parametrize("topo", [star(3), leaf_spine(2, 2)], ids=["star", "tree"])
def test_members_that_disagree_on_the_rank_order_all_fail_naming_it(topo) -> None:
    from fabric.sim.engine import SimulationError

    sim = Simulation(topo)
    with pytest.raises(SimulationError, match="different orders"):
        sim.run(order_workload)
    failed = [n for n in sim._workers if n.error is not None]
    assert len(failed) == len(topo.workers), [n.name for n in failed]  # every member
    assert all("different orders" in str(n.error) for n in failed)


def order_task(ep):
    from fabric.errors import PeerFailed

    ranks = [0, 1, 2] if ep.rank != 1 else [2, 1, 0]
    try:
        ep.group(ranks)
    except PeerFailed as exc:
        return str(exc)
    return "made"


def group_sum_task(ep):
    return ep.group([0, 1, 2]).allreduce(np.arange(5, dtype=np.int32) + ep.rank).tolist()


def test_members_that_disagree_on_the_rank_order_in_emulation(tmp_path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=20) as fab:
        got = fab.run(order_task)
        # the fabric goes on: a group made right works
        again = fab.run(group_sum_task)
    assert all("different orders" in g for g in got), got
    assert again == [(3 * np.arange(5) + 3).tolist()] * 3


@pytest.mark.parametrize("ranks", [["a", 0], [0.5, 1], [True, 0], 3, [0, 0]])
def test_bad_group_ranks_are_a_usage_error(ranks) -> None:
    from fabric.core.collective_programs import group_program
    from fabric.core.programs import NodeState
    from fabric.errors import UsageError

    with pytest.raises(UsageError):
        group_program(NodeState(star(2), "w0"), ranks)


def bad_ranks_workload(ctx, ranks):
    yield ctx.group(ranks)


@pytest.mark.parametrize("ranks", [["a", 0], [0.5, 1], 7])
def test_bad_group_ranks_in_a_workload(ranks) -> None:
    from fabric.sim.engine import SimulationError

    with pytest.raises(SimulationError, match="UsageError"):
        Simulation(star(2)).run(bad_ranks_workload, ranks)


def closed_barrier_task(ep):
    from fabric.errors import UsageError

    c = ep.group([0, 1])
    c.close()
    try:
        c.barrier()
    except UsageError as exc:
        return str(exc)
    return "passed"


def test_a_barrier_on_a_closed_communicator_is_refused(tmp_path) -> None:
    with launch(workers=2, run_dir=tmp_path, timeout_s=20) as fab:
        got = fab.run(closed_barrier_task)
    assert all("closed communicator" in g for g in got), got
