"""Control messages: msgpack maps carried in CTRL frames or on the control socket.

Pure: builds and parses messages, checks their shape. A message is a map with
a ``t`` (type) key; :func:`parse` refuses anything else with a FrameError
(MALFORMED) so a daemon answers it with a NACK and keeps running.
"""

from __future__ import annotations

from typing import Any

import msgpack

from fabric.core.frame import FrameError, NackCode


def pack(t: str, **fields: Any) -> bytes:
    """Encode one control message of type ``t``."""
    fields["t"] = t
    return msgpack.packb(fields, use_bin_type=True)


def parse(payload: bytes | memoryview) -> dict[str, Any]:
    """Decode a control message; malformed input raises FrameError(MALFORMED)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(NackCode.MALFORMED, f"control payload is not msgpack: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise FrameError(NackCode.MALFORMED, "control message must be a map with a 't' string")
    return msg


def need(msg: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """Field ``key`` of ``msg`` checked against ``kind``, else FrameError(INVALID):
    the message arrived intact, and is wrong."""
    value = msg.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise FrameError(
            NackCode.INVALID, f"control message {msg.get('t')!r}: field {key!r} missing or bad"
        )
    return value


class Supervision:
    """A process's view of the one that supervises it (a placed run's coordinator).

    The coordinator pings every process; a process that hears nothing from it
    for ``silence_s`` (its host vanished, its link was cut) gives up instead of
    waiting forever. ``silence_s=None``: no deadline (a local launcher, whose
    death the process sees as a new parent).
    """

    def __init__(self, silence_s: float | None, now: float) -> None:
        self.silence_s = silence_s
        self.last = now

    def heard(self, now: float) -> None:
        """A message came from the supervisor."""
        self.last = now

    def lost(self, now: float) -> bool:
        """True once the supervisor has been silent for longer than ``silence_s``."""
        return self.silence_s is not None and now - self.last > self.silence_s
