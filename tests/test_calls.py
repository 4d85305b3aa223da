"""One member's mistake ends the call on every member, and the next call is
exact (issue 25, part 4; fabric.core.calls), in both worlds.

Before: a rank whose arguments were refused locally left its peers in the call
until their timeout, and its message and job ids no longer matched theirs, so
the next call mixed two calls' data (or timed out)."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.calls import CallScope, abandoned_call, aborted
from fabric.core.frame import Op
from fabric.core.programs import ABORT, CALL_JOBS, NodeState
from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.errors import CallAborted, SemfabError, UsageError
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

W, N, BAD = 3, 1001, 1  # odd size; rank BAD makes the mistake


# ---------------------------------------------------------------- workloads
def wrong_out_then_exact(ctx, path: str, in_group: bool = False):
    """Call 1: rank BAD passes an ``out`` of the wrong size (refused on that rank
    alone). Call 2: an ordinary allreduce. Returns (call 1's error, call 2)."""
    g = (yield ctx.group(list(range(ctx.world)))) if in_group else None
    x = tasks.coll_input(ctx.rank, 0, N, "float32")
    out = np.empty(N + (ctx.rank == BAD), np.float32)
    caught = None
    try:
        yield ctx.allreduce(x, path=path, out=out, group=g)
    except SemfabError as exc:
        caught = exc
    y = tasks.coll_input(ctx.rank, 1, N, "float32")
    z = np.array((yield ctx.allreduce(y, path=path, group=g)))
    if g is not None:
        yield ctx.close_group(g)
    return _outcome(caught), z


def bad_expert_then_exact(ctx, variant: str):
    """MoE: rank BAD names an expert that does not exist; then a valid round."""
    from fabric.core.moe import expert_partials

    T, H, K, E = 9, 8, 2, 6
    x, idx, w = tasks.moe_inputs(ctx.rank, T, H, K, E, "float32")
    bad = idx.copy()
    if ctx.rank == BAD:
        bad[3, 0] = E + 5
    caught = None
    try:
        yield ctx.moe_dispatch(x, bad, w, E, variant=variant)
    except SemfabError as exc:
        caught = exc
    d = yield ctx.moe_dispatch(x, idx, w, E, variant=variant)
    y = yield ctx.moe_combine(d, expert_partials(d, ctx.rank, ctx.world))
    return _outcome(caught), np.array(y)


def mismatched_alltoallv(ctx, calls: int = 3):
    """Call 1: rank BAD expects more from rank 2 than rank 2 sends (each rank's
    counts are fine on their own). Then alltoall calls; returns each call's
    outcome (an error's type, or the output). Rank 0 exchanges correctly with
    both: it may finish call 1 (its part is exact) and then learns, in call 2,
    that the others failed call 1; call 2 then ends on every member."""
    m = 5
    sc, rc = [m] * ctx.world, [m] * ctx.world
    if ctx.rank == BAD:
        rc[2] = m + 2
    x = tasks.coll_input(ctx.rank, 0, m * ctx.world, "float32")
    got: list = []
    try:
        got.append(np.array((yield ctx.alltoallv(x, sc, np.empty(sum(rc), np.float32), rc))))
    except SemfabError as exc:
        got.append(_outcome(exc))
    for c in range(1, calls):
        y = tasks.coll_input(ctx.rank, c, m * ctx.world, "float32")
        try:
            got.append(np.array((yield ctx.alltoall(y))))
        except SemfabError as exc:
            got.append(_outcome(exc))
    return got


def _outcome(exc):
    if exc is None:
        return None
    return type(exc).__name__, str(exc), getattr(exc, "rank", None)


# ---------------------------------------------------------------- checks
def _check_wrong_out(results) -> None:
    want = sum(tasks.coll_input(r, 1, N, "float32") for r in range(W))
    for r in range(W):
        caught, z = results[r]
        assert caught is not None, f"rank {r}: call 1 did not fail"
        kind, text, rank = caught
        if r == BAD:
            assert kind == "UsageError", caught
        else:  # the peers learn who failed and why
            assert kind == "CallAborted" and rank == BAD, caught
            assert "out" in text and f"group rank {BAD}" in text, text
        np.testing.assert_array_equal(z, want, err_msg=f"rank {r}: call 2")


def _check_moe(results) -> None:
    from fabric.core.moe import moe_reference

    T, H, K, E = 9, 8, 2, 6
    ins = [tasks.moe_inputs(r, T, H, K, E, "float32") for r in range(W)]
    want = moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    for r in range(W):
        caught, y = results[r]
        assert caught is not None and caught[0] == ("UsageError" if r == BAD else "CallAborted")
        assert "expert" in caught[1], caught
        np.testing.assert_allclose(y, want[r], rtol=1e-6, err_msg=f"rank {r}")


def _check_alltoallv(results, calls: int) -> None:
    m = 5
    for c in range(calls):
        want = [np.concatenate([tasks.coll_input(k, c, m * W, "float32")[r * m:(r + 1) * m]
                                for k in range(W)]) for r in range(W)]
        for r in range(W):
            got = results[r][c]
            if isinstance(got, tuple):  # a typed error, never a wrong result
                assert got[0] in ("PeerFailed", "PeerRefused", "CallAborted"), got
                assert c < calls - 1, f"rank {r}: the last call failed: {got}"
            else:  # a bystander of the mismatch may finish its part: exact
                np.testing.assert_array_equal(got, want[r], err_msg=f"rank {r} call {c}")
    # the two ranks whose counts disagree both fail that call, naming the sizes
    assert "sizes disagree" in results[BAD][0][1]
    assert isinstance(results[2][0], tuple)


# ---------------------------------------------------------------- simulation
@pytest.mark.parametrize("path", ["ina", "ina-mem", "host-ps", "host-ring"])
def test_a_refused_rank_ends_the_call_everywhere_in_simulation(path) -> None:
    res = Simulation(star(W, hosts=1)).run(wrong_out_then_exact, path)
    _check_wrong_out(res.results)


def test_a_refused_rank_in_a_communicator_in_simulation() -> None:
    res = Simulation(star(W, hosts=1)).run(wrong_out_then_exact, "ina", True)
    _check_wrong_out(res.results)


def test_a_refused_rank_under_loss_in_simulation() -> None:
    """The notices are resent until answered: 10% loss still ends the call on every
    member and the next one is exact."""
    for seed in range(3):
        res = Simulation(star(W, hosts=1), seed=seed, faults="loss=0.1").run(
            wrong_out_then_exact, "ina")
        _check_wrong_out(res.results)


@pytest.mark.parametrize("variant", ["flat", "hierarchical"])
def test_a_bad_expert_id_ends_the_call_everywhere_in_simulation(variant) -> None:
    res = Simulation(star(W)).run(bad_expert_then_exact, variant)
    _check_moe(res.results)


def test_mismatched_alltoallv_counts_in_simulation() -> None:
    res = Simulation(star(W)).run(mismatched_alltoallv, 3)
    _check_alltoallv(res.results, 3)


# ---------------------------------------------------------------- emulation
def wrong_out_task(ep, path, in_group=False):
    return run_in_emulation(ep, wrong_out_then_exact, path, in_group)


def moe_task(ep, variant):
    return run_in_emulation(ep, bad_expert_then_exact, variant)


def alltoallv_task(ep, calls):
    return run_in_emulation(ep, mismatched_alltoallv, calls)


def test_a_refused_rank_ends_the_call_everywhere_in_emulation(tmp_path) -> None:
    with launch(topology=star(W, hosts=1), run_dir=tmp_path, timeout_s=20) as fab:
        for path in ("ina", "ina-mem", "host-ps", "host-ring"):
            _check_wrong_out(fab.run(wrong_out_task, path))
        _check_wrong_out(fab.run(wrong_out_task, "ina", True))
        _check_moe(fab.run(moe_task, "flat"))
        _check_alltoallv(fab.run(alltoallv_task, 3), 3)


# ---------------------------------------------------------------- the pieces
def _state(name: str = "w0") -> NodeState:
    return NodeState(star(W), name)


def _notice(src: int, dst: int, gid: int, inc: int, call: int, rank: int) -> fr.Frame:
    return fr.decode(fr.encode(Op.CTRL, src=src, dst=dst, msg=7, payload=control.pack(
        ABORT, gid=gid, inc=inc, call=call, rank=rank, why="UsageError: bad")))


def test_ids_agree_after_a_call_one_member_abandoned_before_starting() -> None:
    """The member that failed never took the call's message or job ids; the
    others did (and registered a job): the next call's ids agree anyway."""
    a, b = _state("w0").world_group, _state("w1").world_group
    for g in (a, b):
        g.begin_call()
        g.next_msg()
        g.next_job()
    a.begin_call()  # call 2: a runs it (a message, a job), b fails at once
    a.next_msg()
    a.next_job()
    a.abandon()
    b.begin_call()
    b.abandon()
    for g in (a, b):
        g.begin_call()
    assert (a.next_msg(), a.next_job(), a.next_barrier()) == \
        (b.next_msg(), b.next_job(), b.next_barrier())
    assert a._jobs_made == 1 + 1 + CALL_JOBS


def test_a_late_notice_realigns_like_the_others() -> None:
    """A member that finished call 1 learns in call 2 that another member failed
    it: it ends call 2 too, and numbers jobs as the members that realigned at
    call 1 and then ended call 2 on its notice."""
    st = _state("w0")
    late, other = st.world_group, _state("w2").world_group
    for g in (late, other):
        g.begin_call()
        g.next_job()  # call 1 registered a job on both
    other.abandon()  # other failed call 1
    scope = CallScope(st, late)  # late: call 2 begins before the notice arrives
    late.next_job()
    st.answer_stale(_notice(st.worker_ids[1], st.node_id, 0, 0, 1, 1))
    told = scope.peer_failed()
    assert isinstance(told, CallAborted) and told.earlier and told.call == 1
    assert scope.fail(told) is not None  # it tells the others about call 2
    other.begin_call()  # call 2 on the other: ended by the late member's notice
    other.next_job()
    other.abandon()
    for g in (late, other):
        g.begin_call()
    assert late.next_job() == other.next_job()
    assert abandoned_call(st, late, late.calls) is None


def test_notices_from_outside_the_group_are_ignored() -> None:
    st = _state("w0")
    g = st.world_group
    g.begin_call()
    outsider = 10_000  # no member has this id
    answer = st.answer_stale(_notice(outsider, st.node_id, 0, 0, 1, 2))
    assert answer  # answered (the sender stops resending) ...
    assert aborted(st, g, 1) is None  # ... but it ends nothing
    st.answer_stale(_notice(st.worker_ids[2], st.node_id, 0, 99, 1, 2))  # other incarnation
    assert aborted(st, g, 1) is None
    st.answer_stale(_notice(st.worker_ids[2], st.node_id, 0, 0, 1, 2))
    got = aborted(st, g, 1)
    assert isinstance(got, CallAborted) and got.rank == 2 and not got.earlier
    assert st.abort_notices == 3


def test_a_malformed_notice_is_counted_not_raised() -> None:
    st = _state("w0")
    f = fr.decode(fr.encode(Op.CTRL, src=st.worker_ids[1], dst=st.node_id, msg=1,
                            payload=control.pack(ABORT, gid="x", call=1)))
    assert st.answer_stale(f) == []
    assert st.bad_frames == 1 and not st.aborts


def test_the_member_that_fails_raises_its_own_error_alone() -> None:
    """A one-member group has nobody to tell."""
    res = Simulation(star(1)).run(_lonely)
    assert res.results[0] == "UsageError"


def _lonely(ctx):
    try:
        yield ctx.allreduce(np.ones(3, np.float32), path="nowhere")
    except UsageError as exc:
        return type(exc).__name__
