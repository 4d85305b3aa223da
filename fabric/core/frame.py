"""The semfab frame: a compact, memory-semantic header of 32 bytes.

This module is pure (no sockets, no clock): it turns fields into bytes and bytes
into a :class:`Frame`. The byte layout, opcode meanings and the sources of each
field idea are in ``docs/PROTOCOL.md``; this docstring only summarises it.

Wire form (little-endian)::

    header (32 B) | crc32c (4 B, only when Flag.CRC) | payload (length B, only when inline)

On ZeroMQ the same bytes travel as a two-part message: part one is the header
(plus the CRC when present), part two the payload, so a large payload is never
copied to be framed. :func:`decode` accepts either form.

Decoding never trusts its input: any byte string gives a valid :class:`Frame`
or raises :class:`FrameError`, whose ``code`` is the NACK code a receiver sends
back. Encoding bad values is the caller's bug and raises :class:`LocalFrameError`.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import TYPE_CHECKING, Any, Final

import crc32c as _crc32c

if TYPE_CHECKING:
    from typing import Any

    from numpy.typing import NDArray
    from typing_extensions import Buffer

__all__ = [
    "MASK_BITS",
    "MASKED_FLOW",
    "VERSION",
    "HEADER_SIZE",
    "CRC_SIZE",
    "MAX_PAYLOAD",
    "Op",
    "Flag",
    "DType",
    "NackCode",
    "TRANSIENT_NACKS",
    "PERMANENT_NACKS",
    "Frame",
    "FRAME_FIELDS",
    "FrameError",
    "LocalFrameError",
    "encode",
    "encode_header",
    "encode_into",
    "encode_ack",
    "encode_nack",
    "decode",
    "decode_trimmed",
    "is_trimmed",
    "trimmable",
    "STREAM_FLOWS",
    "COMBINE_FLOW",
    "POST_FLOW",
    "mark_ce",
    "peek",
    "DTYPE_SIZES",
    "DTYPE_NAMES",
    "dtype_from_name",
    "flag_of",
]

#: Protocol version carried in the high nibble of byte 0 (docs/PROTOCOL.md "Versioning").
VERSION: Final = 1
#: Header type in the low nibble of byte 0; 0 is the 32-byte base header.
#: Other values are reserved for extension headers.
HEADER_TYPE_BASE: Final = 0

# B ver/type, B opcode, B flags, B dtype, H src, H dst, H job, H flow,
# I psn, I key, I offset, I length, I msg  -> 32 bytes
_HEADER: Final = struct.Struct("<BBBBHHHHIIIII")
HEADER_SIZE: Final = _HEADER.size
assert HEADER_SIZE == 32
_CRC: Final = struct.Struct("<I")
CRC_SIZE: Final = _CRC.size
#: Largest payload length the 32-bit length field can name.
MAX_PAYLOAD: Final = 0xFFFF_FFFF
# ACK frames reuse the key+offset words as one 64-bit SACK bitmap (as UET ACK_CC
# carries a SACK bitmap beside the cumulative PSN).
_SACK: Final = struct.Struct("<Q")
_SACK_OFFSET: Final = 16


class Op(IntEnum):
    """Opcodes. Which header fields each one uses is in docs/PROTOCOL.md."""

    WRITE = 1  # store payload at (key, offset)
    READ = 2  # ask for `length` bytes at (key, offset); always referenced
    READ_RESP = 3  # answer to READ, payload = the bytes
    REDUCE = 4  # contribute payload to aggregation slot (job, psn = chunk)
    RESULT = 5  # aggregated result of a chunk
    ATOMIC_ADD = 6  # add one element of dtype at (key, offset)
    FETCH_ADD = 7  # like ATOMIC_ADD, old value returned in READ_RESP
    ACK = 8  # psn = cumulative ack, key|offset = 64-bit SACK bitmap
    NACK = 9  # psn = offending PSN, offset = NackCode
    CTRL = 10  # control message, payload = msgpack map
    CREDIT = 11  # receiver grants `offset` bytes to the stream (job, msg) on flow - 1


class Flag(IntFlag):
    """Header flag bits."""

    NONE = 0
    FIRST = 0x01  # first frame of a message
    LAST = 0x02  # last frame of a message
    ACK_REQ = 0x04  # receiver should acknowledge now
    RETX = 0x08  # this is a retransmission
    REF = 0x10  # payload referenced by (key, offset, length), not inline
    ECN = 0x20  # congestion experienced (set by a switch)
    CRC = 0x40  # a CRC32C of header + payload follows the header
    MCAST = 0x80  # dst is a multicast group, not a node id

    # IntFlag's own & and | build the result through the enum machinery (about
    # 0.8 us each, several per frame on every side); the 8-bit results come
    # from a table of the 256 members instead.
    def __and__(self, other: Any) -> Any:
        f = _FLAG_OF.get(int.__and__(self, other))
        return f if f is not None else IntFlag.__and__(self, other)

    def __or__(self, other: Any) -> Any:
        f = _FLAG_OF.get(int.__or__(self, other))
        return f if f is not None else IntFlag.__or__(self, other)

    # written out, not aliased (``__rand__ = __and__``): compiled, an alias fails
    def __rand__(self, other: Any) -> Any:
        return self.__and__(other)

    def __ror__(self, other: Any) -> Any:
        return self.__or__(other)


class DType(IntEnum):
    """Element type of the payload; RAW means opaque bytes."""

    RAW = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    I32 = 4
    I64 = 5
    U8 = 6


DTYPE_SIZES: Final[dict[DType, int]] = {
    DType.RAW: 1,
    DType.F32: 4,
    DType.F16: 2,
    DType.BF16: 2,
    DType.I32: 4,
    DType.I64: 8,
    DType.U8: 1,
}
#: The project-wide dtype names (kernels and numpy use these strings).
DTYPE_NAMES: Final[dict[DType, str]] = {
    DType.RAW: "raw",
    DType.F32: "float32",
    DType.F16: "float16",
    DType.BF16: "bfloat16",
    DType.I32: "int32",
    DType.I64: "int64",
    DType.U8: "uint8",
}
_DTYPE_BY_NAME: Final = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_from_name(name: str) -> DType:
    """Map a dtype name ("float32", ...) to its :class:`DType` code."""
    try:
        return _DTYPE_BY_NAME[name]
    except KeyError:
        valid = ", ".join(sorted(_DTYPE_BY_NAME))
        raise LocalFrameError(f"unknown dtype {name!r}; valid: {valid}") from None


class NackCode(IntEnum):
    """Why a frame was refused (carried in a NACK's offset field)."""

    MALFORMED = 1  # could not be decoded
    BAD_KEY = 2  # region key unknown
    PERMISSION = 3  # key known, sender not allowed / out of region bounds
    OUT_OF_WINDOW = 4  # PSN or chunk outside the receive window
    NO_RESOURCE = 5  # no slot / buffer / budget for it
    BAD_CHECKSUM = 6  # CRC32C mismatch
    UNSUPPORTED = 7  # version or header type we do not speak
    UNKNOWN_JOB = 8  # aggregation job not registered
    MISSING = 9  # the switch waits for this contribution (later ones came): send it again
    INVALID = 10  # intact (decoded, CRC good) but not acceptable here: the sender's mistake
    OVERFLOW = 11  # the chunk's integer sum would wrap: told to every member, once each
    TRIMMED = 12  # a switch cut the payload for lack of buffer: send the frame again now


#: Refusals a resend can cure: the frame was damaged (MALFORMED: it could not be
#: decoded, BAD_CHECKSUM), came out of its window or before room was free, or was
#: lost (MISSING) or trimmed (TRIMMED). The reliability layer retries these within
#: its limits.
TRANSIENT_NACKS: Final = frozenset({NackCode.MALFORMED, NackCode.OUT_OF_WINDOW,
                                    NackCode.NO_RESOURCE, NackCode.BAD_CHECKSUM,
                                    NackCode.MISSING, NackCode.TRIMMED})
#: Refusals no resend can cure (a permission, an unknown key or job, a protocol we
#: do not speak, an intact frame that is wrong): the call ends, naming the cause.
PERMANENT_NACKS: Final = frozenset(set(NackCode) - TRANSIENT_NACKS)


_OP_VALUES: Final = frozenset(int(o) for o in Op)
_DTYPE_VALUES: Final = frozenset(int(d) for d in DType)
_NACK_VALUES: Final = frozenset(int(c) for c in NackCode)
# Lookup tables: constructing enum members per frame costs microseconds.
_OP_BY_VALUE: Final = {int(o): o for o in Op}
_DTYPE_BY_VALUE: Final = {int(d): d for d in DType}
_FLAGS_BY_VALUE: Final = [Flag(i) for i in range(256)]
_FLAG_OF: Final = dict(enumerate(_FLAGS_BY_VALUE))
_SIZE_BY_VALUE: Final = {int(d): n for d, n in DTYPE_SIZES.items()}
_F_REF: Final = int(Flag.REF)
_F_CRC: Final = int(Flag.CRC)
_F_ECN: Final = int(Flag.ECN)
_F_MCAST: Final = int(Flag.MCAST)
_EMPTY: Final = memoryview(b"")
_VT_BASE: Final = (VERSION << 4) | HEADER_TYPE_BASE


def flag_of(bits: int) -> Flag:
    """The :class:`Flag` of an 8-bit value, from a table (building one through the
    enum machinery costs a microsecond)."""
    return _FLAGS_BY_VALUE[bits]

# Opcodes that never carry data bytes: their length must be 0 (ACK/NACK/CREDIT)
# or name remote memory (READ, which must say so with Flag.REF).
_NO_DATA_OPS: Final = frozenset({Op.ACK, Op.NACK, Op.CREDIT})
# Atomics carry exactly one element.
_ATOMIC_OPS: Final = frozenset({Op.ATOMIC_ADD, Op.FETCH_ADD})


class FrameError(Exception):
    """A peer sent bytes that are not a valid frame.

    ``code`` is the :class:`NackCode` to answer with. The receiver counts the
    error, NACKs where it can, and keeps running.
    """

    def __init__(self, code: NackCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocalFrameError(ValueError):
    """The local caller asked to encode something the format cannot carry."""


#: A frame's payload: a view of the received buffer. An alias, because compiled
#: (mypyc) a field annotated with the builtin itself once failed at import.
Payload = memoryview

#: The fields of a :class:`Frame`, in header order (``payload`` and ``version`` last).
FRAME_FIELDS: Final = ("op", "flags", "dtype", "src", "dst", "job", "flow", "psn", "key",
                       "offset", "length", "msg", "payload", "version")


class Frame:
    """A decoded frame. ``payload`` is a view into the received buffer (no copy).

    A slotted class, not a named tuple: compiled (mypyc) it is a native class,
    whose fields every hot path reads as C struct members instead of through
    the tuple's descriptors (``decode`` builds one per frame on every receive
    path). Immutable by convention; :meth:`replace` gives a changed copy.
    """

    __slots__ = FRAME_FIELDS

    op: Op
    flags: Flag
    dtype: DType
    src: int
    dst: int
    job: int
    flow: int
    psn: int
    key: int
    offset: int
    length: int
    msg: int
    payload: Payload
    version: int

    def __init__(self, op: Op, flags: Flag, dtype: DType, src: int, dst: int, job: int,
                 flow: int, psn: int, key: int, offset: int, length: int, msg: int,
                 payload: Payload, version: int = VERSION) -> None:
        self.op = op
        self.flags = flags
        self.dtype = dtype
        self.src = src
        self.dst = dst
        self.job = job
        self.flow = flow
        self.psn = psn
        self.key = key
        self.offset = offset
        self.length = length
        self.msg = msg
        self.payload = payload
        self.version = version

    def fields(self) -> tuple[Any, ...]:
        """The fields as a tuple, in :data:`FRAME_FIELDS` order."""
        return (self.op, self.flags, self.dtype, self.src, self.dst, self.job, self.flow,
                self.psn, self.key, self.offset, self.length, self.msg, self.payload,
                self.version)

    def replace(self, **changes: Any) -> Frame:
        """A copy with ``changes`` (field name -> value) applied."""
        values = dict(zip(FRAME_FIELDS, self.fields(), strict=True))
        for name in changes:
            if name not in values:
                raise TypeError(f"Frame has no field {name!r}")
        values.update(changes)
        return Frame(**values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return self.fields() == other.fields()

    __hash__ = None  # type: ignore[assignment]  # payload views are not hashable

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(FRAME_FIELDS, self.fields(),
                                                         strict=True))
        return f"Frame({inner})"

    def has(self, flag: int) -> bool:
        """True when any of the bits of ``flag`` (a :class:`Flag`) is set: on int
        values, since a :class:`Flag` operator goes through the enum machinery."""
        return int(self.flags) & int(flag) != 0

    @property
    def referenced(self) -> bool:
        """True when the data lives in registered memory, not in the frame."""
        return int(self.flags) & _F_REF != 0

    @property
    def elements(self) -> int:
        """Number of dtype elements the frame names (inline or referenced)."""
        return self.length // _SIZE_BY_VALUE[self.dtype]

    @property
    def sack(self) -> int:
        """ACK only: bit i set = PSN ``psn + 1 + i`` received (psn is cumulative)."""
        if self.op is not Op.ACK:
            raise AttributeError("sack exists on ACK frames only")
        return self.key | (self.offset << 32)

    @property
    def nack_code(self) -> NackCode:
        """NACK only: why the frame ``psn`` was refused."""
        if self.op is not Op.NACK:
            raise AttributeError("nack_code exists on NACK frames only")
        return NackCode(self.offset)


# Opcodes as plain ints for the encoder's checks (enum attribute lookups and
# comparisons cost more than the packing itself).
_READ: Final = int(Op.READ)
_ACK: Final = int(Op.ACK)
_NACK: Final = int(Op.NACK)
_CREDIT: Final = int(Op.CREDIT)
_WRITE: Final = int(Op.WRITE)
_REDUCE: Final = int(Op.REDUCE)
_ATOMIC_ADD: Final = int(Op.ATOMIC_ADD)
_FETCH_ADD: Final = int(Op.FETCH_ADD)


def _check_fields(
    op: int,
    flags: int,
    dtype: int,
    length: int,
    inline_len: int,
) -> None:
    """Local validation shared by the encoders (the format's own rules)."""
    if op not in _OP_VALUES:
        raise LocalFrameError(f"unknown opcode {op}")
    size = _SIZE_BY_VALUE.get(dtype)
    if size is None:
        raise LocalFrameError(f"unknown dtype code {dtype}")
    if (op == _ACK or op == _NACK or op == _CREDIT) and (length or inline_len):
        raise LocalFrameError(f"{Op(op).name} frames carry no payload")
    if op == _READ and not flags & _F_REF:
        raise LocalFrameError("READ frames name remote memory: set Flag.REF")
    if flags & _F_REF and inline_len:
        raise LocalFrameError("a referenced frame (Flag.REF) carries no inline payload")
    if length % size:
        raise LocalFrameError(
            f"length {length} is not a multiple of the {DType(dtype).name} size {size}"
        )
    if (op == _ATOMIC_ADD or op == _FETCH_ADD) and length != size:
        raise LocalFrameError(f"{Op(op).name} carries exactly one element")


def encode_header(
    op: Op | int,
    *,
    src: int = 0,
    dst: int = 0,
    job: int = 0,
    flow: int = 0,
    psn: int = 0,
    key: int = 0,
    offset: int = 0,
    msg: int = 0,
    dtype: DType | int = DType.RAW,
    flags: Flag | int = Flag.NONE,
    payload: Buffer | NDArray[Any] = b"",
    length: int | None = None,
    crc: bool = False,
) -> bytes:
    """Return the header part (32 bytes, 36 with ``crc``) of a two-part frame.

    The payload is not copied into the result: send it as the second part.
    For a referenced frame (``Flag.REF``) pass ``length`` and no payload.
    ``crc=True`` sets ``Flag.CRC`` and appends CRC32C(header + payload).
    """
    # numpy arrays and typed views count in bytes; a view is made only when needed
    inline_len: int
    if isinstance(payload, bytes):
        inline_len = len(payload)
    elif isinstance(payload, memoryview):
        inline_len = payload.nbytes
    else:
        inline_len = memoryview(payload).nbytes  # type: ignore[arg-type]  # ndarray is a buffer
    # ints under their own names: compiled, the checks are then native int ops
    # IntEnum members are ints: compiled, these unbox them without a call, and
    # ``+ 0`` turns a Flag into a plain int (its own ``|`` and ``&`` are slower)
    code: int = op
    dt: int = dtype
    bits: int = flags + 0
    if crc:
        bits |= _F_CRC
    if code == _READ and not bits & _F_REF:
        raise LocalFrameError("READ frames name remote memory: set Flag.REF")
    size: int = inline_len if length is None else length
    if length is not None and not bits & _F_REF and length != inline_len:
        raise LocalFrameError(f"length {length} does not match the payload ({inline_len} B)")
    _check_fields(code, bits, dt, size, inline_len)
    try:
        header: bytes = _HEADER.pack(
            _VT_BASE, code, bits, dt, src, dst, job, flow, psn, key, offset, size, msg)
    except struct.error as exc:
        raise LocalFrameError(f"a field is out of range for its width: {exc}") from None
    if bits & _F_CRC:
        value = _crc32c.crc32c(header)
        if inline_len:
            pview = memoryview(payload)  # type: ignore[arg-type]
            if pview.ndim != 1 or pview.itemsize != 1:
                pview = pview.cast("B")
            value = _crc32c.crc32c(pview, value)
        return header + _CRC.pack(value)
    return header


def encode(op: Op | int, **fields: object) -> bytes:
    """Return one contiguous frame: header [+ crc] + inline payload.

    Takes the same keyword arguments as :func:`encode_header`.
    """
    header = encode_header(op, **fields)  # type: ignore[arg-type]
    payload = fields.get("payload")
    if payload is None:
        return header
    return header + memoryview(payload).cast("B").tobytes()  # type: ignore[arg-type]


def encode_into(buf: bytearray | memoryview, op: Op | int, **fields: object) -> int:
    """Write one contiguous frame into ``buf`` from position 0; return its size.

    Raises :class:`LocalFrameError` when ``buf`` is too small.
    """
    header = encode_header(op, **fields)  # type: ignore[arg-type]
    payload = fields.get("payload")
    pview = memoryview(payload).cast("B") if payload is not None else memoryview(b"")  # type: ignore[arg-type]
    plen = pview.nbytes
    total = len(header) + plen
    view = memoryview(buf).cast("B")
    if view.nbytes < total:
        raise LocalFrameError(f"buffer of {view.nbytes} B is too small for a {total} B frame")
    view[: len(header)] = header
    if plen:
        view[len(header) : total] = pview
    return total


def encode_ack(
    *, src: int, dst: int, flow: int, cum_psn: int, sack: int = 0, job: int = 0, msg: int = 0
) -> bytes:
    """An ACK: every PSN up to ``cum_psn`` received; bit i of ``sack`` = ``cum_psn+1+i``."""
    if not 0 <= sack < 1 << 64:
        raise LocalFrameError("sack bitmap must fit 64 bits")
    return encode_header(
        Op.ACK,
        src=src,
        dst=dst,
        job=job,
        flow=flow,
        psn=cum_psn,
        key=sack & 0xFFFF_FFFF,
        offset=sack >> 32,
        msg=msg,
    )


def encode_nack(
    *, src: int, dst: int, flow: int, psn: int, code: NackCode, job: int = 0, msg: int = 0,
    key: int = 0, crc: bool = False,
) -> bytes:
    """A NACK refusing frame ``psn`` of ``flow`` with ``code``; ``key`` is free for
    the code's own use (MISSING: the later PSN that shows ``psn`` was lost)."""
    return encode_header(
        Op.NACK, src=src, dst=dst, job=job, flow=flow, psn=psn, offset=int(code), msg=msg,
        key=key, crc=crc,
    )


def decode(buf: bytes | bytearray | memoryview, payload: object = None) -> Frame:
    """Decode a frame without copying its payload.

    ``buf`` is either a whole contiguous frame or, when ``payload`` is given,
    the header part of a two-part message (``payload`` being the second part).
    Returns a :class:`Frame` or raises :class:`FrameError`; never anything else.
    """
    view: memoryview | None = None
    if isinstance(buf, bytes):  # the usual header part: unpacked as it is, no view
        head: bytes = buf
        size = len(head)
    else:
        try:
            view = memoryview(buf)
            if view.ndim != 1 or view.itemsize != 1:
                view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise FrameError(NackCode.MALFORMED, f"not a byte buffer: {exc}") from None
        size = view.nbytes
        head = bytes(view[:HEADER_SIZE + CRC_SIZE])  # a copy of 36 bytes at most
    if size < HEADER_SIZE:
        raise FrameError(
            NackCode.MALFORMED, f"short frame: {size} B, the header alone is {HEADER_SIZE} B"
        )
    # declared ints: compiled, the checks below are then native, not generic ops
    vt: int
    op: int
    flags: int
    dtype: int
    length: int
    offset: int
    (vt, op, flags, dtype, src, dst, job, flow, psn, key, offset, length, msg) = (
        _HEADER.unpack_from(head)
    )
    if vt != _VT_BASE:
        version, htype = vt >> 4, vt & 0x0F
        if version != VERSION:
            raise FrameError(
                NackCode.UNSUPPORTED, f"unsupported version {version}; this end speaks {VERSION}"
            )
        raise FrameError(NackCode.UNSUPPORTED, f"unknown header type {htype}")
    opc = _OP_BY_VALUE.get(op)
    if opc is None:
        raise FrameError(NackCode.MALFORMED, f"unknown opcode {op}")
    dt = _DTYPE_BY_VALUE.get(dtype)
    if dt is None:
        raise FrameError(NackCode.MALFORMED, f"unknown dtype code {dtype}")
    pos = HEADER_SIZE
    has_crc = flags & _F_CRC
    crc_value = 0
    if has_crc:
        if size < pos + CRC_SIZE:
            raise FrameError(NackCode.MALFORMED, "CRC flag set but the CRC32C field is missing")
        (crc_value,) = _CRC.unpack_from(head, pos)
        pos += CRC_SIZE
    referenced = flags & _F_REF
    body: memoryview
    if payload is None:
        if size == pos:
            body = _EMPTY
        else:
            if view is None:
                view = memoryview(head)
            body = view[pos:]
        nbytes = size - pos
    else:
        if size != pos:
            raise FrameError(
                NackCode.MALFORMED, f"header part is {size} B, expected {pos} B for these flags"
            )
        try:
            body = payload if isinstance(payload, memoryview) else \
                memoryview(payload)  # type: ignore[arg-type]
            if body.ndim != 1 or body.itemsize != 1:
                body = body.cast("B")
        except (TypeError, ValueError) as exc:
            raise FrameError(NackCode.MALFORMED, f"payload part is not bytes: {exc}") from None
        nbytes = len(body)
    if referenced:
        if nbytes:
            raise FrameError(
                NackCode.MALFORMED,
                f"referenced frame (REF flag) carries {nbytes} inline bytes; expected none",
            )
    elif nbytes != length:
        raise FrameError(
            NackCode.MALFORMED,
            f"payload length field says {length} B but {nbytes} B follow",
        )
    esize = _SIZE_BY_VALUE[dtype]
    if length % esize:
        raise FrameError(
            NackCode.MALFORMED,
            f"length {length} is not a multiple of the {dt.name} element size {esize}",
        )
    if op >= _ATOMIC_ADD:  # the rarely used opcodes: ATOMIC_ADD .. CTRL
        if (op == _ACK or op == _NACK or op == _CREDIT) and length:
            raise FrameError(NackCode.MALFORMED, f"{opc.name} frame with length {length}; "
                             "expected 0")
        if (op == _ATOMIC_ADD or op == _FETCH_ADD) and length != esize:
            raise FrameError(NackCode.MALFORMED, f"{opc.name} must carry exactly one {dt.name}")
        if op == _NACK and offset not in _NACK_VALUES:
            raise FrameError(NackCode.MALFORMED, f"NACK with unknown code {offset}")
    elif op == _READ and not referenced:
        raise FrameError(NackCode.MALFORMED, "READ frame without the REF flag")
    if has_crc:
        computed = _crc32c.crc32c(head[:HEADER_SIZE])
        if nbytes:
            computed = _crc32c.crc32c(body, computed)
        if computed != crc_value:
            raise FrameError(
                NackCode.BAD_CHECKSUM,
                f"CRC32C mismatch: frame says {crc_value:#010x}, computed {computed:#010x}",
            )
    return Frame(opc, _FLAGS_BY_VALUE[flags], dt, src, dst, job, flow, psn, key, offset,
                 length, msg, body, VERSION)


#: The flows of reliable streams: point-to-point (16) and the collectives' (20);
#: their ACKs and NACKs travel on flow + 1. Their receivers answer a trimmed frame
#: with a TRIMMED NACK, so these are the frames a switch trims (others it drops).
STREAM_FLOWS: Final = (16, 20)
#: The flow of masked multicast rows (in-network MoE dispatch; ACKs and NACKs on
#: flow + 1): their receivers too answer a trimmed copy with a TRIMMED NACK.
MASKED_FLOW: Final = 22
#: The flow of in-network MoE combine frames (REDUCE): a rank's partials to its
#: switch, and the switch's finished sums to each token's home, whose receiver
#: answers a trimmed sum with a TRIMMED NACK to the switch that sent it.
COMBINE_FLOW: Final = 24
#: The flow of posts (fabric.core.posting: bytes handed to a node in the
#: background; ACKs and NACKs on flow + 1): a receiver answers a trimmed one
#: with a TRIMMED NACK too.
POST_FLOW: Final = 26
#: A masked multicast frame (Flag.MCAST, ``key`` != 0) names its members by bits:
#: bit i of ``key`` is member ``MASK_BITS * offset + i`` of the group, by id, so
#: ``offset`` picks a block of 32 and one frame reaches members of one block.
MASK_BITS: Final = 32


def trimmable(header: bytes | bytearray | memoryview) -> bool:
    """Whether a switch may trim this frame rather than drop it: a unicast WRITE of a
    stream (:data:`STREAM_FLOWS`) or a post (:data:`POST_FLOW`), a masked multicast
    row (:data:`MASKED_FLOW`) or a combine frame (:data:`COMBINE_FLOW`), whose
    receivers ask for it again at once."""
    view = memoryview(header)
    if view.nbytes < HEADER_SIZE:
        return False
    if view[1] == _REDUCE:
        return bool(_HEADER.unpack_from(view)[7] == COMBINE_FLOW and not view[2] & _F_MCAST)
    if view[1] != _WRITE:
        return False
    fields = _HEADER.unpack_from(view)
    if view[2] & _F_MCAST:
        return fields[7] == MASKED_FLOW and fields[9] != 0  # flow; key: a member mask
    return fields[7] in STREAM_FLOWS or fields[7] == POST_FLOW


def is_trimmed(header: bytes | bytearray | memoryview, payload: object = None) -> bool:
    """Whether a two-part message is a trimmed frame: a header part alone (no payload
    part, or an empty one) whose ``length`` names inline bytes. A switch sends that
    when its buffer has no room for the payload (``[congestion] trim``)."""
    view = memoryview(header)
    if view.nbytes < HEADER_SIZE or (payload is not None and memoryview(payload).nbytes):  # type: ignore[arg-type]
        return False
    flags = view[2]
    if flags & _F_REF or view.nbytes != HEADER_SIZE + (CRC_SIZE if flags & _F_CRC else 0):
        return False
    return bool(_HEADER.unpack_from(view)[11])


def decode_trimmed(buf: bytes | bytearray | memoryview) -> Frame:
    """Decode the header of a trimmed frame (:func:`is_trimmed`): a :class:`Frame`
    whose payload is empty while ``length`` still says how many bytes were cut.

    Every header field is checked as :func:`decode` does, except the CRC32C: it
    covered the payload, which is gone."""
    view = memoryview(buf)
    if view.nbytes < HEADER_SIZE:
        raise FrameError(NackCode.MALFORMED, f"short header: {view.nbytes} B")
    fields = list(_HEADER.unpack_from(view))
    flags, length = fields[2], fields[11]
    if not length or flags & _F_REF:
        raise FrameError(NackCode.MALFORMED, "not a trimmed frame: it names no inline bytes")
    fields[2], fields[11] = flags & ~_F_CRC, 0
    f = decode(_HEADER.pack(*fields), b"")
    if length % _SIZE_BY_VALUE[fields[3]]:
        raise FrameError(NackCode.MALFORMED, f"trimmed frame of length {length}: not a "
                         f"multiple of the {f.dtype.name} element size")
    return f.replace(length=length, flags=_FLAGS_BY_VALUE[flags])


def mark_ce(header: bytes | bytearray | memoryview, payload: object = None) -> bytes:
    """The header part with ``Flag.ECN`` (congestion experienced) set, its CRC32C
    computed again when it has one (as a router rewrites a checksum it changes)."""
    head = bytearray(memoryview(header)[:HEADER_SIZE])
    head[2] |= _F_ECN
    if not head[2] & _F_CRC:
        return bytes(head)
    value = _crc32c.crc32c(head)
    if payload is not None:
        body = memoryview(payload)  # type: ignore[arg-type]
        if body.nbytes:
            value = _crc32c.crc32c(body if body.ndim == 1 and body.itemsize == 1
                                   else body.cast("B"), value)
    return bytes(head) + _CRC.pack(value)


def peek(buf: bytes | bytearray | memoryview) -> tuple[Op, Flag, int, int, int, int, int, int]:
    """Read ``(op, flags, src, job, psn, key, offset, length)`` from a header part.

    For a receiver that must choose where to put the payload before it reads
    it (``recv_into`` straight into the destination). Only the version and
    opcode are checked; call :func:`decode` once the payload is in place.
    """
    view = memoryview(buf)
    if view.nbytes < HEADER_SIZE:
        raise FrameError(NackCode.MALFORMED, f"short header: {view.nbytes} B")
    (vt, op, flags, _dt, src, _dst, job, _flow, psn, key, offset, length, _msg) = (
        _HEADER.unpack_from(view)
    )
    if vt != _VT_BASE:
        raise FrameError(NackCode.UNSUPPORTED, f"unsupported version/type byte {vt:#04x}")
    opc = _OP_BY_VALUE.get(op)
    if opc is None:
        raise FrameError(NackCode.MALFORMED, f"unknown opcode {op}")
    return opc, _FLAGS_BY_VALUE[flags], src, job, psn, key, offset, length
