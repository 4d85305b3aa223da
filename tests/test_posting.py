"""fabric.core.posting: posts handed to a node in the background (ctx.post): the
pure outbox and inbox over a lossy channel on a fake clock, and in simulation
on links shared with other traffic."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core import frame as fr
from fabric.core.posting import POST_FLOW, Inbox, Outbox
from fabric.core.programs import NodeState
from fabric.core.topology import star
from fabric.errors import UsageError
from fabric.sim import Simulation, SimulationError

TOPO = star(2, bandwidth_gbps=1.0, latency_us=10.0, hosts=1)


def _exchange(sizes: list[int], seed: int, loss: float) -> tuple[Outbox, Inbox]:
    """Post ``sizes`` from w0 to host0 through a channel that loses, delays and
    reorders frames both ways (seeded), stepping a fake clock until all is ACKed."""
    rng = random.Random(seed)
    w0 = NodeState(TOPO, "w0")
    host = TOPO.node("host0").id
    box, inbox = Outbox(w0), Inbox(host)
    now = 0.0
    wire: list[tuple[float, bytes, object, str]] = []  # (due, header, payload, to)

    def put(sends: list[tuple[bytes, object]], to: str) -> None:
        for header, payload in sends:
            if rng.random() >= loss:
                wire.append((now + rng.uniform(1e-5, 5e-4), header, payload, to))

    for i, n in enumerate(sizes):
        number, sends = box.post(host, n, now)
        assert number == i
        put(sends, "host")
    for _ in range(100_000):
        if box.done and not wire:
            break
        timer = box.get_timer()
        nxt = min((w[0] for w in wire), default=None)
        if timer is not None and (nxt is None or timer < nxt):
            now = timer
            put(box.handle_timer(now), "host")
            continue
        assert nxt is not None, "nothing in flight and nothing due, yet not done"
        wire.sort(key=lambda w: w[0])
        due, header, payload, to = wire.pop(0)
        now = due
        f = fr.decode(header, payload)
        if to == "host":
            assert Inbox.wants(f)
            put(inbox.handle_frame(f, now), "w0")
        else:
            assert box.wants(f)
            put(box.handle_frame(f, now), "host")
    assert box.done
    return box, inbox


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 200_000), min_size=1, max_size=6),
       seed=st.integers(0, 2**16), loss=st.sampled_from([0.0, 0.1, 0.3]))
def test_every_post_is_whole_exactly_once_through_loss_and_reorder(
        sizes: list[int], seed: int, loss: float) -> None:
    box, inbox = _exchange(sizes, seed, loss)
    got = sorted((a.post, a.nbytes) for a in inbox.arrivals)
    assert got == list(enumerate(sizes))
    assert inbox.statistics().posts == len(sizes)


def test_a_lost_frame_is_sent_again() -> None:
    box, inbox = _exchange([100_000] * 3, seed=7, loss=0.3)
    assert box.st.retransmits > 0 and len(inbox.arrivals) == 3


def test_bad_posts_are_refused() -> None:
    box = Outbox(NodeState(TOPO, "w0"))
    with pytest.raises(UsageError, match="nbytes from 1"):
        box.post(TOPO.node("host0").id, 0, 0.0)
    with pytest.raises(UsageError, match="nbytes from 1"):
        box.post(TOPO.node("host0").id, 1 << 32, 0.0)
    for name in ("w0", "sw0"):  # itself, a switch
        with pytest.raises(UsageError, match="not another worker or host"):
            box.post(TOPO.node(name).id, 10, 0.0)


def _tokens_and_checkpoint(ctx, steps: int, step_s: float, ckpt: int):  # type: ignore[no-untyped-def]
    """w0 posts 32 bytes every ``step_s`` (a decoder's tokens) and goes on at once;
    w1 posts ``ckpt`` bytes to the same host as w0 starts (a checkpoint)."""
    posts = []
    if ctx.rank == 1 and ckpt:
        yield ctx.post("host0", ckpt)
    if ctx.rank == 0:
        for _ in range(steps):
            t = yield ctx.clock()
            posts.append(((yield ctx.post("host0", 32)), t))
            yield ctx.compute(step_s)
    return posts


def _delays(ckpt: int) -> list[float]:
    res = Simulation(TOPO).run(_tokens_and_checkpoint, 8, 200e-6, ckpt)
    w0 = TOPO.node("w0").id
    whole = {a.post: a.t for a in res.posts["host0"] if a.src == w0}
    return [whole[n] - t for n, t in res.results[0]]


def test_posts_go_on_in_the_background_and_queue_behind_a_checkpoint() -> None:
    quiet = _delays(0)
    # alone: each post takes the path's time (two 1 Gb/s links of 10 us), and the
    # workload did not wait for it (a step every 200 us)
    wire = 2 * (10e-6 + (32 + fr.HEADER_SIZE) * 8 / 1e9)
    assert quiet == pytest.approx([wire] * 8, rel=1e-6)
    # beside 1 MB to the same host: the tokens queue behind its frames on host0's link
    busy = _delays(1_000_000)
    assert max(busy) > 10 * wire and len(busy) == 8


def test_the_run_ends_when_every_post_is_whole() -> None:
    def once(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 0:
            yield ctx.post("host0", 500_000)  # 4 ms on the wire; the workload ends now
        return (yield ctx.clock())

    res = Simulation(TOPO).run(once)
    assert res.results[0] == 0.0 and [a.nbytes for a in res.posts["host0"]] == [500_000]
    assert res.posts["host0"][0].t > 4e-3


def test_a_post_to_no_such_node_fails_where_it_was_asked() -> None:
    def bad(ctx):  # type: ignore[no-untyped-def]
        try:
            yield ctx.post("host9", 10)
        except UsageError as exc:
            return str(exc)
        return "posted"

    res = Simulation(TOPO).run(bad)
    assert all("no such node" in r for r in res.results)


def test_a_post_under_eqds_is_refused() -> None:
    from fabric.core.congestion.settings import CongestionSettings

    topo = TOPO.with_congestion(CongestionSettings(cc="eqds", buffer_bytes=1_000_000))

    def post(ctx):  # type: ignore[no-untyped-def]
        yield ctx.post("host0", 10)

    with pytest.raises(SimulationError, match="eqds"):
        Simulation(topo).run(post)


def test_posts_run_in_simulation_only() -> None:
    from fabric.core.workload import Post
    from fabric.emulation.workloads import perform

    with pytest.raises(UsageError, match="simulation only"):
        perform(object(), Post("host0", 10))


def test_post_frames_ack_on_the_next_flow() -> None:
    w0 = NodeState(TOPO, "w0")
    host = TOPO.node("host0").id
    _n, sends = Outbox(w0).post(host, 10, 0.0)
    f = fr.decode(*sends[0])
    assert (f.op, f.flow, f.key, f.msg) == (fr.Op.WRITE, POST_FLOW, 10, 0)
    (ack, _none), = Inbox(host).handle_frame(f, 1e-3)
    a = fr.decode(ack)
    assert (a.op, a.flow, a.dst, a.psn) == (fr.Op.ACK, POST_FLOW + 1, w0.node_id, f.psn)


def test_posts_are_whole_through_lossy_links_in_simulation() -> None:
    def many(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 0:
            for _ in range(20):
                yield ctx.post("host0", 20_000)
                yield ctx.compute(50e-6)

    res = Simulation(TOPO, faults="loss=0.05", seed=3).run(many)
    assert sorted(a.post for a in res.posts["host0"]) == list(range(20))
    assert res.retransmits > 0


def test_a_trimmed_post_frame_is_asked_for_again_at_once() -> None:
    """Two workers post 1 MB each to host0 at once through a switch whose 60 kB
    buffer trims: host0 NACKs each cut frame, its sender resends it without a
    timeout, and both posts are whole about when the link could carry them."""
    from fabric.core.congestion.settings import CongestionSettings

    topo = star(2, bandwidth_gbps=1.0, latency_us=10.0, hosts=1, mtu=9000).with_congestion(
        CongestionSettings(buffer_bytes=60_000, trim=True))

    def burst(ctx):  # type: ignore[no-untyped-def]
        yield ctx.post("host0", 1_000_000)

    res = Simulation(topo).run(burst)
    assert sorted(a.nbytes for a in res.posts["host0"]) == [1_000_000] * 2
    assert res.trims > 0 and res.overflow_drops == 0
    assert all(n.timeouts == 0 for n in res.nodes.values())
    ideal = 2_000_000 * 8 / 1e9  # host0's link carries both
    assert max(a.t for a in res.posts["host0"]) < 1.5 * ideal
