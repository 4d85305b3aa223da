"""What crosses the fabric between generator, relay and host (pure).

* The **token record**: 32 bytes, little-endian, fixed layout; the ``direct``
  transport WRITEs arrays of them into the host's token ring (one region key,
  one byte offset per frame) and the host reads the fields in place::

      u32 rid | u32 index | u32 token | u16 flags | u16 pad | i64 t_gen_ns | i64 t_sent_ns

* The **staged message** of ``host-staged``: a msgpack map
  ``{"s": session, "q": message number, "w": origin node, "r": [[rid, index,
  token, flags, t_gen, t_sent], ...]}``; the relay adds ``"ri"``/``"ro"``, its
  receive and send times.
* **Control messages** (CTRL frames, :mod:`fabric.core.control` maps) named ``sv_*``.

Times are :func:`fabric.serving.clock.now_ns` values: CLOCK_MONOTONIC, shared by
every process of one host, and on rank 0's timeline on a placed fabric, so they
compare across processes and hosts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from fabric.core.frame import FrameError, NackCode

RECORD = struct.Struct("<IIIHHqq")
RECORD_SIZE = RECORD.size
assert RECORD_SIZE == 32
#: The same layout as a NumPy structured dtype (the generator fills records
#: with vector stores, as a sampling kernel would).
RECORD_DTYPE = np.dtype([
    ("rid", "<u4"), ("index", "<u4"), ("token", "<u4"), ("flags", "<u2"), ("pad", "<u2"),
    ("t_gen", "<i8"), ("t_sent", "<i8"),
])
assert RECORD_DTYPE.itemsize == RECORD_SIZE

#: Record flags.
LAST = 0x1  # the sequence's final token (max_tokens reached)

#: Frame flow ids of the token chain (beside the collectives' flows).
TOKEN_FLOW = 0x7A01  # direct: WRITE of records into the token ring
STAGED_FLOW = 0x7A02  # host-staged: msgpack messages (worker -> relay -> host)

# Control message types.
CONFIG = "sv_config"  # host -> worker: ring key/offset, transport, session
READY = "sv_ready"  # worker -> host
ADD = "sv_add"  # host -> worker: start a sequence
ABORT = "sv_abort"  # host -> worker: drop a sequence (client went away)
STOP = "sv_stop"  # host -> worker/relay: end the task
STOPPED = "sv_stopped"  # worker/relay -> host: STOP received (the host resends until then)
PING = "sv_ping"  # host -> relay
PONG = "sv_pong"  # relay -> host
FAIL = "sv_fail"  # worker -> host: the generator failed
SENT = "sv_sent"  # worker -> host, while idle: the next token-frame PSN (tail-loss probe)


def iter_records(buf: memoryview | bytes) -> Iterator[tuple[int, int, int, int, int, int, int]]:
    """Fields of every record in ``buf`` (a whole number of records), read in place."""
    if len(buf) % RECORD_SIZE:
        raise FrameError(NackCode.MALFORMED,
                         f"token records: {len(buf)} B is not a multiple of {RECORD_SIZE}")
    return RECORD.iter_unpack(buf)


def pack_staged(session: int, seq: int, origin: int, rows: list[list[int]]) -> bytes:
    """Encode one staged message (the serialisation ``host-staged`` pays for)."""
    return msgpack.packb({"s": session, "q": seq, "w": origin, "r": rows}, use_bin_type=True)


def unpack_staged(payload: memoryview | bytes) -> dict[str, Any]:
    """Decode a staged message; anything malformed raises FrameError(MALFORMED)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(NackCode.MALFORMED, f"staged message is not msgpack: {exc}") from None
    if (not isinstance(msg, dict) or not isinstance(msg.get("r"), list)
            or not isinstance(msg.get("s"), int) or not isinstance(msg.get("q"), int)):
        raise FrameError(NackCode.MALFORMED, "staged message must be a map with s, q and r")
    for row in msg["r"]:
        if not isinstance(row, list) or len(row) != 6 or not all(isinstance(v, int) for v in row):
            raise FrameError(NackCode.MALFORMED, "staged record must be 6 integers")
    return msg


def repack_staged(msg: dict[str, Any]) -> bytes:
    """Encode a (relayed) staged message again."""
    return msgpack.packb(msg, use_bin_type=True)
