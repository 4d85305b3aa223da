"""Pieces of the switch daemon and the host node that need no sockets."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.core import control
from fabric.core.frame import FrameError, NackCode
from fabric.core.hostnode import HostAggregator
from fabric.core.memory import AccessError, RegionInfo, RegionTable
from fabric.core.reliability import unwrap_psn


@given(st.integers(0, 2**40), st.integers(-(2**20), 2**20))
def test_unwrap_psn_recovers_chunks_near_the_last_one(last: int, delta: int) -> None:
    chunk = last + delta
    if chunk < 0:
        return
    assert unwrap_psn(chunk & 0xFFFF_FFFF, last) == chunk


def test_region_table_checks_key_bounds_and_owner() -> None:
    t = RegionTable()
    t.add(RegionInfo(key=7, owner=1, size=100, path="/dev/shm/x", allowed=frozenset({2})))
    assert t.check(7, 0, 100, 2).owner == 1
    with pytest.raises(AccessError) as e:
        t.check(8, 0, 1, 1)
    assert e.value.code is NackCode.BAD_KEY
    with pytest.raises(AccessError) as e:
        t.check(7, 90, 20, 1)
    assert e.value.code is NackCode.PERMISSION and "outside region" in str(e.value)
    with pytest.raises(AccessError, match="may not use"):
        t.check(7, 0, 1, 3)
    with pytest.raises(AccessError, match="already belongs"):
        t.add(RegionInfo(key=7, owner=5, size=1, path="p"))
    with pytest.raises(AccessError, match="nonzero"):
        t.add(RegionInfo(key=0, owner=5, size=1, path="p"))


def test_control_parse_refuses_garbage_with_malformed() -> None:
    assert control.parse(control.pack("hello", name="w0")) == {"t": "hello", "name": "w0"}
    for bad in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"x": 1})):
        with pytest.raises(FrameError) as e:
            control.parse(bad)
        assert e.value.code is NackCode.MALFORMED
    with pytest.raises(FrameError, match="field 'job'"):
        control.need({"t": "job", "job": "seven"}, "job", int)


def _host_msg(seq: int, chunk: int, data: np.ndarray, members=(0, 1), op="sum") -> bytes:
    return msgpack.packb({"seq": seq, "chunk": chunk, "members": list(members), "op": op,
                          "dtype": "float32", "data": data.tobytes()})


def test_host_aggregator_sums_once_all_members_arrived() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    h = HostAggregator()
    assert h.on_message(0, _host_msg(1, 0, a)) == []
    assert h.on_message(0, _host_msg(1, 0, a)) == []  # duplicate: not counted twice
    replies = h.on_message(1, _host_msg(1, 0, b))
    assert [dst for dst, _ in replies] == [0, 1]
    got = np.frombuffer(msgpack.unpackb(replies[0][1])["data"], np.float32)
    np.testing.assert_array_equal(got, a + b)
    assert h.stats.duplicates == 1 and h.stats.completed == 1


def test_host_aggregator_refuses_bad_messages() -> None:
    h = HostAggregator()
    with pytest.raises(FrameError) as e:
        h.on_message(0, b"not msgpack at all")
    assert e.value.code is NackCode.MALFORMED
    with pytest.raises(FrameError) as e:
        h.on_message(9, _host_msg(1, 0, np.ones(3, np.float32)))
    assert e.value.code is NackCode.PERMISSION
