"""Refusals are classified once (issue 25, part 3): damage is a retransmission,
only a permanent refusal ends a call, and every frame a switch originates is
checked by its receiver."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import frame as fr
from fabric.core.frame import PERMANENT_NACKS, TRANSIENT_NACKS, NackCode, Op
from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from tests import fabric_tasks as tasks
from tests.test_switch_core import Net, _job

N, CALLS = 7, 20  # tiny frames: a flipped bit often lands in the header


def small_calls(ctx, n: int, calls: int):
    out = []
    for c in range(calls):
        x = tasks.coll_input(ctx.rank, c, n, "int32")
        out.append(np.array((yield ctx.allreduce(x, path="ina"))))
    return out


def _check(results, world: int) -> None:
    for r in range(world):
        for c, got in enumerate(results[r]):
            want = sum(tasks.coll_input(k, c, N, "int32") for k in range(world))
            np.testing.assert_array_equal(got, want, err_msg=f"rank {r} call {c}")


def test_every_code_is_transient_or_permanent() -> None:
    assert TRANSIENT_NACKS | PERMANENT_NACKS == set(NackCode)
    assert not TRANSIENT_NACKS & PERMANENT_NACKS
    assert NackCode.MALFORMED in TRANSIENT_NACKS  # undecodable: damage, for all we know
    assert NackCode.INVALID in PERMANENT_NACKS  # intact and wrong: the sender's mistake


@pytest.mark.parametrize("seed", [0, 2, 5])
def test_a_damaged_header_is_resent_not_fatal_in_simulation(seed) -> None:
    """Seeds 0, 2 and 5 ended the call with a MALFORMED refusal on one rank."""
    res = Simulation(star(3), seed=seed, faults="corrupt=0.1", crc=True).run(
        small_calls, N, CALLS)
    _check(res.results, 3)
    c = res.switch_stats["sw0"]
    assert c.nack_codes.get("BAD_CHECKSUM", 0) + c.nack_codes.get("MALFORMED", 0) > 0


def small_calls_task(ep, n: int, calls: int):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, small_calls, n, calls)


def test_a_damaged_header_is_resent_not_fatal_in_emulation(tmp_path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=30, faults="corrupt=0.1",
                seed=2) as fab:
        res = fab.run(small_calls_task, N, CALLS)
    _check(res, 3)


def test_an_intact_but_wrong_frame_is_refused_invalid() -> None:
    net = Net(star(2))
    _job(net)  # int32
    w0 = net.topo.node("w0")
    x = np.ones(4, np.float32)
    net.send("w0", fr.encode_header(Op.REDUCE, src=w0.id, dst=net.topo.node("sw0").id, job=1,
                                    psn=0, dtype=fr.dtype_from_name("float32"), payload=x,
                                    crc=True), x)
    (nack,) = net.take("w0")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.INVALID
    assert nack.flags & fr.Flag.CRC  # the switch's own frames are always checked


def wrong_out_workload(ctx):
    x = tasks.coll_input(ctx.rank, 0, N, "int32")
    yield ctx.allreduce(x, out=np.empty(N - 1, np.int32))


def test_an_allreduce_out_of_the_wrong_shape_is_a_usage_error() -> None:
    """Was a NumPy broadcasting ValueError from inside the call."""
    from fabric.sim.engine import SimulationError

    with pytest.raises(SimulationError, match="UsageError: .*out must be"):
        Simulation(star(2)).run(wrong_out_workload)
