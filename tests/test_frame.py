"""Frame codec: round trips, fuzzing, golden vectors and the error contract."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core import frame as fr
from fabric.core.frame import DTYPE_SIZES, DType, Flag, FrameError, LocalFrameError, NackCode, Op

VECTORS = Path(__file__).parent / "vectors"

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
data_ops = [op for op in Op if op not in (Op.ACK, Op.NACK, Op.CREDIT, Op.READ)]


@st.composite
def frame_fields(draw: st.DrawFn) -> dict:
    op = draw(st.sampled_from(list(Op)))
    dtype = draw(st.sampled_from(list(DType)))
    size = DTYPE_SIZES[dtype]
    flags = draw(st.sampled_from([0, Flag.FIRST, Flag.LAST, Flag.FIRST | Flag.LAST | Flag.RETX,
                                  Flag.ECN | Flag.ACK_REQ, Flag.MCAST]))
    fields = dict(src=draw(u16), dst=draw(u16), job=draw(u16), flow=draw(u16), psn=draw(u32),
                  key=draw(u32), offset=draw(u32), msg=draw(u32), dtype=dtype,
                  crc=draw(st.booleans()))
    if op in (Op.ACK, Op.NACK, Op.CREDIT):
        fields["dtype"] = DType.RAW
        if op is Op.NACK:
            fields["offset"] = int(draw(st.sampled_from(list(NackCode))))
        fields["flags"] = flags
        return {"op": op, **fields}
    if op in (Op.ATOMIC_ADD, Op.FETCH_ADD):
        n = 1
    else:
        n = draw(st.integers(0, 64))
    referenced = op is Op.READ or (op not in (Op.ATOMIC_ADD, Op.FETCH_ADD) and draw(st.booleans()))
    if referenced:
        fields["flags"] = flags | Flag.REF
        fields["length"] = n * size
    else:
        fields["flags"] = flags
        fields["payload"] = draw(st.binary(min_size=n * size, max_size=n * size))
    return {"op": op, **fields}


@settings(max_examples=400, deadline=None)
@given(frame_fields(), st.booleans())
def test_round_trip_every_opcode_and_dtype(fields: dict, two_part: bool) -> None:
    fields = dict(fields)
    op = fields.pop("op")
    payload = fields.get("payload", b"")
    if two_part:
        header = fr.encode_header(op, **fields)
        f = fr.decode(header, payload)
    else:
        wire = fr.encode(op, **fields)
        f = fr.decode(wire)
    assert f.op == op
    for name in ("src", "dst", "job", "flow", "psn", "key", "offset", "msg"):
        assert getattr(f, name) == fields[name], name
    assert f.dtype == fields["dtype"]
    assert bytes(f.payload) == bytes(payload)
    assert f.length == fields.get("length", len(payload))
    assert bool(f.flags & Flag.CRC) == fields["crc"]
    assert f.flags & ~Flag.CRC == fields["flags"]


@settings(max_examples=200, deadline=None)
@given(u32, st.integers(0, (1 << 64) - 1))
def test_ack_carries_cumulative_psn_and_64_bit_sack(cum: int, sack: int) -> None:
    f = fr.decode(fr.encode_ack(src=1, dst=2, flow=3, cum_psn=cum, sack=sack))
    assert (f.op, f.psn, f.sack) == (Op.ACK, cum, sack)


def test_nack_code_round_trip() -> None:
    for code in NackCode:
        f = fr.decode(fr.encode_nack(src=4, dst=5, flow=6, psn=99, code=code))
        assert (f.op, f.psn, f.nack_code) == (Op.NACK, 99, code)


def test_payload_is_a_view_not_a_copy() -> None:
    wire = bytearray(fr.encode(Op.WRITE, dtype=DType.F32, payload=np.arange(4, dtype=np.float32)))
    f = fr.decode(wire)
    wire[-4:] = np.float32(42).tobytes()
    assert np.frombuffer(f.payload, np.float32)[-1] == 42


def test_encode_into_matches_encode() -> None:
    data = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    buf = bytearray(1024)
    n = fr.encode_into(buf, Op.REDUCE, dtype=DType.F32, payload=data, psn=3, crc=True)
    assert bytes(buf[:n]) == fr.encode(Op.REDUCE, dtype=DType.F32, payload=data, psn=3, crc=True)
    with pytest.raises(LocalFrameError, match="too small"):
        fr.encode_into(bytearray(10), Op.REDUCE, dtype=DType.F32, payload=data)


@pytest.mark.parametrize(
    ("mutate", "code", "message"),
    [
        (lambda b: b[:20], NackCode.MALFORMED, "short frame"),
        (lambda b: bytes([0x20]) + b[1:], NackCode.UNSUPPORTED, "unsupported version"),
        (lambda b: bytes([0x11]) + b[1:], NackCode.UNSUPPORTED, "header type"),
        (lambda b: b[:1] + bytes([99]) + b[2:], NackCode.MALFORMED, "unknown opcode"),
        (lambda b: b[:3] + bytes([77]) + b[4:], NackCode.MALFORMED, "unknown dtype"),
        (lambda b: b[:-1], NackCode.MALFORMED, "length field says"),
        (lambda b: b + b"x", NackCode.MALFORMED, "length field says"),
        (lambda b: b[:3] + bytes([DType.I64]) + b[4:], NackCode.MALFORMED, "not a multiple"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0x10]), NackCode.BAD_CHECKSUM, "CRC32C mismatch"),
        (lambda b: b[:34], NackCode.MALFORMED, "CRC32C field is missing"),
        (lambda b: b[:38], NackCode.MALFORMED, "length field says"),
    ],
)
def test_each_malformation_has_its_own_message(mutate, code: NackCode, message: str) -> None:
    # 3 float32 = 12 B: relabelled as int64 the length is no longer a multiple.
    good = fr.encode(Op.REDUCE, dtype=DType.F32, payload=np.arange(3, dtype=np.float32), crc=True)
    with pytest.raises(FrameError, match=message) as info:
        fr.decode(mutate(good))
    assert info.value.code == code


def test_semantic_rules_are_enforced_on_decode() -> None:
    import struct

    def raw(op: int, flags: int = 0, dtype: int = 0, length: int = 0, offset: int = 0) -> bytes:
        return struct.pack("<BBBBHHHHIIIII", 0x10, op, flags, dtype, 0, 0, 0, 0, 0, 0, offset,
                           length, 0)

    with pytest.raises(FrameError, match="READ frame without the REF flag"):
        fr.decode(raw(Op.READ, length=0))
    with pytest.raises(FrameError, match="carries 4 inline bytes"):
        fr.decode(raw(Op.WRITE, flags=Flag.REF, length=8) + b"abcd")
    with pytest.raises(FrameError, match="ACK frame with length"):
        fr.decode(raw(Op.ACK, flags=Flag.REF, length=8))
    with pytest.raises(FrameError, match="exactly one"):
        fr.decode(raw(Op.ATOMIC_ADD, dtype=DType.I64, length=16) + bytes(16))
    with pytest.raises(FrameError, match="NACK with unknown code"):
        fr.decode(raw(Op.NACK, offset=200))
    with pytest.raises(FrameError, match="CRC32C field is missing"):
        fr.decode(raw(Op.CTRL, flags=Flag.CRC))
    with pytest.raises(FrameError, match="header part"):
        fr.decode(fr.encode(Op.WRITE, payload=b"abc"), b"abc")


def test_local_errors_for_bad_fields() -> None:
    with pytest.raises(LocalFrameError, match="out of range"):
        fr.encode(Op.WRITE, src=70000)
    with pytest.raises(LocalFrameError, match="carry no payload"):
        fr.encode(Op.ACK, payload=b"x")
    with pytest.raises(LocalFrameError, match="set Flag.REF"):
        fr.encode(Op.READ, length=4)
    with pytest.raises(LocalFrameError, match="not a multiple"):
        fr.encode(Op.WRITE, dtype=DType.F32, payload=b"abc")
    with pytest.raises(LocalFrameError, match="unknown dtype"):
        fr.dtype_from_name("float8")


def test_random_bytes_raise_only_frame_error() -> None:
    rng = random.Random(20261201)
    good = [
        fr.encode(Op.REDUCE, dtype=DType.F32, payload=bytes(16), crc=True),
        fr.encode(Op.WRITE, payload=b"hello"),
        fr.encode_ack(src=1, dst=2, flow=3, cum_psn=4, sack=5),
        fr.encode(Op.READ, flags=Flag.REF, length=64),
    ]
    for i in range(100_000):
        if i % 2:
            data = rng.randbytes(rng.choice([0, 1, 31, 32, 33, 36, 40, 48, 64, 100]))
        else:  # mutate a valid frame so the fuzz reaches the deep checks
            b = bytearray(rng.choice(good))
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            if rng.random() < 0.2:
                b = b[: rng.randrange(len(b) + 1)]
            data = bytes(b)
        try:
            f = fr.decode(data)
        except FrameError:
            continue
        # anything accepted must re-encode to the same bytes
        assert isinstance(f, fr.Frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=128))
def test_hypothesis_fuzz_only_frame_error(data: bytes) -> None:
    try:
        fr.decode(data)
    except FrameError:
        pass


def _vector_cases() -> list[Path]:
    return sorted(VECTORS.glob("*.hex"))


def test_golden_vectors_exist() -> None:
    assert len(_vector_cases()) >= 8


@pytest.mark.parametrize("path", _vector_cases(), ids=lambda p: p.stem)
def test_golden_vectors(path: Path) -> None:
    """Each vector: comment lines with the expected fields, then the frame as hex."""
    expect: dict[str, str] = {}
    hexdata = ""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            if "=" in line:
                k, v = line[1:].split("=", 1)
                expect[k.strip()] = v.strip()
        else:
            hexdata += line.strip()
    data = bytes.fromhex(hexdata)
    if "error" in expect:
        with pytest.raises(FrameError) as info:
            fr.decode(data)
        assert info.value.code.name == expect["error"]
        return
    f = fr.decode(data)
    assert f.op.name == expect["op"]
    assert f.dtype.name == expect["dtype"]
    for name in ("src", "dst", "job", "flow", "psn", "key", "offset", "length", "msg"):
        assert getattr(f, name) == int(expect[name], 0), name
    assert int(f.flags) == int(expect["flags"], 0)
    assert bytes(f.payload).hex() == expect.get("payload", "")


def test_flag_arithmetic_is_int_arithmetic_with_flag_results() -> None:
    # Flag's & and | come from a table: the same values and types as IntFlag's
    for a in range(256):
        fa = Flag(a)
        for b in (0, 1, 0x10, 0x48, 0x80, 0xFF, a ^ 0x5A):
            for got, want in ((fa & b, a & b), (b & fa, a & b), (fa | b, a | b),
                              (b | fa, a | b), (fa & Flag(b), a & b), (fa | Flag(b), a | b)):
                assert isinstance(got, Flag) and int(got) == want
    assert int(Flag.REF | 0x100) == 0x110  # beyond 8 bits: IntFlag's own answer
    with pytest.raises(TypeError):
        Flag.REF & "x"  # type: ignore[operator]


@given(st.binary(min_size=1, max_size=300), st.booleans(), u32)
def test_a_congestion_mark_keeps_every_field_and_a_valid_crc(body: bytes, crc: bool,
                                                              psn: int) -> None:
    header = fr.encode_header(Op.WRITE, src=1, dst=2, flow=16, psn=psn, offset=7,
                              payload=body, crc=crc)
    marked = fr.mark_ce(header, body)
    got, want = fr.decode(marked, body), fr.decode(header, body)
    assert got.flags == want.flags | Flag.ECN
    assert got.replace(flags=want.flags, payload=b"") == want.replace(payload=b"")
    assert bytes(got.payload) == body


@given(st.binary(min_size=1, max_size=300), st.booleans(), u32)
def test_a_trimmed_frame_is_told_from_a_damaged_one(body: bytes, crc: bool, psn: int) -> None:
    header = fr.encode_header(Op.WRITE, src=1, dst=2, flow=16, job=5, psn=psn, msg=9,
                              payload=body, crc=crc)
    assert fr.is_trimmed(header, None) and fr.is_trimmed(header, b"")
    assert not fr.is_trimmed(header, body)
    with pytest.raises(FrameError):  # decode refuses it: the payload is missing
        fr.decode(header, b"")
    cut = fr.decode_trimmed(header)
    assert (cut.op, cut.src, cut.job, cut.psn, cut.msg, cut.length) == (
        Op.WRITE, 1, 5, psn, 9, len(body))
    assert cut.payload.nbytes == 0


def test_frames_without_inline_bytes_are_not_trimmed() -> None:
    ack = fr.encode_ack(src=1, dst=2, flow=17, cum_psn=3)
    assert not fr.is_trimmed(ack, None)
    assert not fr.is_trimmed(b"\x00" * 8, None)
    with pytest.raises(FrameError, match="not a trimmed frame"):
        fr.decode_trimmed(ack)
