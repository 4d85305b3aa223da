"""The host-ps aggregator (fabric.core.hostnode): its reply is each member's ACK,
echoing congestion marks and how long it held each member's message."""

from __future__ import annotations

import msgpack
import numpy as np

from fabric.core.hostnode import HostAggregator


def _message(chunk: int, members: list[int], data: np.ndarray) -> bytes:
    return msgpack.packb({"seq": 1, "inc": 0, "chunk": chunk, "members": members, "op": "sum",
                          "dtype": "float32", "data": data.tobytes()})


def test_the_reply_echoes_marks_and_the_wait_for_the_slowest_member() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(37).astype(np.float32) for _ in range(3)]
    host = HostAggregator()
    assert host.on_message(10, _message(0, [10, 11, 12], xs[0]), ce=True, now=1.0) == []
    assert host.on_message(12, _message(0, [10, 11, 12], xs[2]), now=1.5) == []
    replies = host.on_message(11, _message(0, [10, 11, 12], xs[1]), now=4.0)
    assert [dst for dst, _ in replies] == [10, 11, 12]
    reply = msgpack.unpackb(replies[0][1])
    np.testing.assert_array_equal(np.frombuffer(reply["data"], np.float32),
                                  xs[0] + xs[2] + xs[1])
    assert reply["ce"] == [10]  # only member 10's message came marked
    assert dict(reply["held"]) == {10: 3.0, 12: 2.5, 11: 0.0}
