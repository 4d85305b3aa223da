"""A seeded fuzz of the frame decoder and of the switch (issue 25): random,
mutated and replayed frames from another tenant's worker, 100k and more, between
the contributions of a job. No exception escapes, the job's results stay exact,
and the counters say what was refused."""

from __future__ import annotations

import numpy as np

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, Op
from switchd.core import COMBINE_FLOW
from tests import fabric_tasks as tasks
from tests.test_switch_core import Net

SEED = 2025
DECODE_FRAMES = 100_000
SWITCH_FRAMES = 100_000
CHUNKS = 50  # the victim's chunks; a burst of fuzz before each one's last contribution


def _mutate(rng: np.random.Generator, frame: bytes) -> bytes:
    """One of: flipped bits, a rewritten header field, a cut, random bytes appended."""
    b = bytearray(frame)
    kind = rng.integers(4)
    if kind == 0:
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(len(b)))
            b[i] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        off = int(rng.choice([1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28]))
        width = 1 if off < 4 else (2 if off < 12 else 4)
        b[off:off + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
    elif kind == 2:
        b = b[:int(rng.integers(len(b)))]
    else:
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    return bytes(b)


def test_the_decoder_raises_only_frame_errors() -> None:
    rng = np.random.default_rng(SEED)
    x = rng.integers(-9, 9, 37).astype(np.int32)
    seeds = [fr.encode(Op.REDUCE, src=1, dst=4, job=3, psn=9, dtype=fr.DType.I32, payload=x,
                       crc=c) for c in (False, True)]
    seeds += [fr.encode(Op.CTRL, src=1, dst=4, payload=control.pack("barrier", id=5, n=2)),
              fr.encode_nack(src=4, dst=1, flow=0, psn=3, code=fr.NackCode.MISSING),
              fr.encode_ack(src=4, dst=1, flow=7, cum_psn=12, sack=5)]
    decoded = refused = 0
    for i in range(DECODE_FRAMES):
        if i % 4 == 0:
            raw = rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8).tobytes()
        else:
            raw = _mutate(rng, seeds[i % len(seeds)])
        try:
            fr.decode(raw)
            decoded += 1
        except FrameError as exc:
            assert isinstance(exc.code, fr.NackCode)
            refused += 1
    assert decoded + refused == DECODE_FRAMES and refused > DECODE_FRAMES // 2


def test_a_foreign_tenants_fuzz_never_reaches_a_result() -> None:
    topo = tasks.tenant_topology(2)  # tenant a: w0 w1 (the victim), b: w2 w3
    net = Net(topo)
    sw = topo.node("sw0").id
    w0, w1, w2 = (topo.node(n).id for n in ("w0", "w1", "w2"))
    for name in ("w0", "w1"):
        net.ctrl(name, "job", job=1, members=[w0, w1], dtype="int32", op="sum", slots=4,
                 slot_elems=64)
        assert control.parse(net.take(name)[-1].payload)["granted"]
    rng = np.random.default_rng(SEED)
    core = net.cores["sw0"]
    before = core.statistics()
    genuine: list[bytes] = []  # the victim's frames, for replay and mutation
    per_burst = SWITCH_FRAMES // CHUNKS
    sent = 0
    for chunk in range(CHUNKS):
        xs = [rng.integers(-1000, 1000, 61).astype(np.int32) for _ in range(2)]
        first = fr.encode(Op.REDUCE, src=w0, dst=sw, job=1, psn=chunk, dtype=fr.DType.I32,
                          payload=xs[0])
        genuine.append(first)
        net.send("w0", first)
        for _ in range(per_burst):  # w2 (tenant b) between the two contributions
            kind = rng.integers(6)
            if kind == 0:  # replayed as is: claims src w0 on w2's port
                raw = genuine[int(rng.integers(len(genuine)))]
            elif kind == 1:  # replayed with its own src: not a member
                f = fr.decode(genuine[int(rng.integers(len(genuine)))])
                raw = fr.encode(Op.REDUCE, src=w2, dst=sw, job=1, psn=f.psn,
                                dtype=fr.DType.I32, payload=np.full(61, 777, np.int32))
            elif kind == 2:  # mutated
                raw = _mutate(rng, genuine[int(rng.integers(len(genuine)))])
            elif kind == 3:  # control aimed at the victim's job and group state
                t = ["release", "barrier", "group_release", "job"][int(rng.integers(4))]
                raw = fr.encode(Op.CTRL, src=w2, dst=sw, payload=control.pack(
                    t, job=1, id=int(rng.integers(1, 256)) << 32 | 1, n=2, members=[w0, w1],
                    nth=0, dtype="int32", op="sum", slots=4, slot_elems=64, inc=0))
            elif kind == 4:  # a combine partial for the victim
                body = np.concatenate([np.array([chunk], np.int32).view(np.float32),
                                       np.full(4, 777.0, np.float32)])
                raw = fr.encode(Op.REDUCE, src=w2, dst=w0, flow=COMBINE_FLOW, job=1, psn=0,
                                key=2, offset=1, msg=1, dtype=fr.DType.F32, payload=body)
            else:  # random bytes
                raw = rng.integers(0, 256, int(rng.integers(0, 120)), dtype=np.uint8).tobytes()
            net.send("w2", raw)  # never raises: the switch's guard answers everything
            sent += 1
        net.take("w2")
        net.take("w3")
        net.send("w1", fr.encode(Op.REDUCE, src=w1, dst=sw, job=1, psn=chunk,
                                 dtype=fr.DType.I32, payload=xs[1]))
        for name in ("w0", "w1"):
            results = [f for f in net.take(name) if f.op is Op.RESULT and f.psn == chunk]
            assert results, f"{name}: no result for chunk {chunk}"
            np.testing.assert_array_equal(np.frombuffer(results[-1].payload, np.int32),
                                          xs[0] + xs[1], err_msg=f"{name} chunk {chunk}")
    after = core.statistics()
    assert sent >= SWITCH_FRAMES
    assert after.frames_in - before.frames_in >= sent + 2 * CHUNKS
    refused = (after.unauthorised - before.unauthorised) + (after.malformed - before.malformed)
    assert refused >= sent // 3, (refused, sent)
    assert after.nack_codes.get("PERMISSION", 0) > 0
    assert after.nack_codes.get("MALFORMED", 0) + after.nack_codes.get("BAD_CHECKSUM", 0) > 0
    assert core.job_phase(1) is not None and core.job_phase(1).name == "GRANTED"
