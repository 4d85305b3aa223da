"""Allreduce, four ways, on the same fabric and processes.

* ``ina``       frame plane: chunks travel in REDUCE frames, the switch sums
                them in its slot pool and sends the RESULT back; received
                straight into the output with ``recv_into``.
* ``ina-mem``   memory plane: frames carry only (key, offset, length); the
                switch reduces from every member's registered region and
                stores the result into each of them.
* ``host-ps``   the host-staged way: staging copy, msgpack message through the
                switch (forwarding only) to the host node, NumPy sum, reply,
                decode, copy back.
* ``host-ring`` ring reduce-scatter + all-gather between workers through the
                switch, with the staging copies.

Each path counts its semantic distance (fabric.semantic) where the work
happens. Windows are self-clocked: a chunk is sent only when the result of
the chunk ``S`` places before it came back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import zmq

from fabric import frame as fr
from fabric import transport
from fabric.errors import FabricTimeout, PeerFailed, UsageError
from fabric.frame import Flag, Op
from fabric.timers import ChunkTimers

if TYPE_CHECKING:
    from fabric.endpoint import Endpoint

log = logging.getLogger("semfab.collectives")

PSN_MASK = 0xFFFF_FFFF
#: Flow ids that tell a host-staged message's kind apart at the receiver.
HOST_PS_FLOW = 2
RING_FLOW = 3
#: Defaults; overridable per endpoint (ep.chunk_bytes / ep.slots).
DEFAULT_CHUNK_BYTES = {"ina": 256 * 1024, "ina-mem": 4 * 1024 * 1024,
                       "host-ps": 256 * 1024, "host-ring": 256 * 1024}
DEFAULT_SLOTS = {"ina": 8, "ina-mem": 4, "host-ps": 8}
#: Memory plane: split a tensor into at least this many chunks (pipelining),
#: but never below this chunk size: on an unshaped host every chunk costs
#: wake-ups (measured, 2 workers: 1 MiB in one chunk 0.85 ms, in four 1.65 ms);
#: on shaped links chunks must be small enough to pipeline over the wire.
MEM_MIN_CHUNKS = 8
MEM_MIN_CHUNK_BYTES = 4 * 1024 * 1024
MEM_MIN_CHUNK_BYTES_SHAPED = 256 * 1024

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@dataclass
class JobState:
    """A registered aggregation job as one worker sees it."""

    job: int
    slots: int
    slot_elems: int
    granted: bool
    reason: str
    next_chunk: int = 0


def _chunk_elems(ep: Endpoint, path: str, itemsize: int) -> int:
    nbytes = ep.chunk_bytes.get(path, DEFAULT_CHUNK_BYTES[path])
    if path in ("ina", "host-ps", "host-ring"):
        nbytes = min(nbytes, ep.mtu)  # one chunk = one frame on the frame plane
    return max(nbytes // itemsize, 1)


def _job(ep: Endpoint, path: str, dtype: str, op: str, itemsize: int) -> JobState:
    key = (path, dtype, op)
    st = ep.jobs.get(key)
    if st is not None:
        return st
    # Workers call collectives in the same order, so the same job id comes out.
    job = next(ep.job_seq)
    slots = ep.slots.get(path, DEFAULT_SLOTS[path])
    elems = _chunk_elems(ep, path, itemsize)
    reply = ep.request("job", "job_reply", job=job, members=list(ep.worker_ids), dtype=dtype,
                       op=op, slots=slots, slot_elems=elems, referenced=path == "ina-mem")
    st = JobState(job, slots, elems, bool(reply.get("granted")), str(reply.get("reason", "")))
    if not st.granted:
        note = (f"{path} job {job} refused by switch ({st.reason}); falling back to "
                f"{_fallback_name(ep)}")
        log.warning("%s: %s", ep.name, note)
        ep.fallbacks.append(note)
    ep.jobs[key] = st
    return st


def _fallback_name(ep: Endpoint) -> str:
    return "host-ps" if ep.host_id is not None else "host-ring"


def _fallback(ep: Endpoint, x: np.ndarray, out: np.ndarray, op: str, dtype: str,
              path: str) -> None:
    """The host path a refused in-network job runs on instead (the note says which);
    its semantic distance is counted under the path the caller asked for."""
    if ep.host_id is not None:
        allreduce_host_ps(ep, x, out, op, dtype, label=path)
    else:
        allreduce_host_ring(ep, x, out, op, dtype, label=path)


def _route_cost(ep: Endpoint, dst: int) -> tuple[int, int]:
    """(hops, crossings) of one payload sent from this node to node ``dst``."""
    src_name, dst_name = ep.name, ep.topo.by_id(dst).name
    switches = len(ep.topo.route(src_name, dst_name))
    return switches, switches + 1


# ---------------------------------------------------------------------- ina
def allreduce_ina(ep: Endpoint, x: np.ndarray, out: np.ndarray, op: str, dtype: str) -> None:
    """Frame-plane in-network allreduce."""
    st = _job(ep, "ina", dtype, op, x.itemsize)
    if not st.granted:
        _fallback(ep, x, out, op, dtype, "ina")
        return
    E, S, n = st.slot_elems, st.slots, x.size
    nch = -(-n // E)
    base = st.next_chunk
    st.next_chunk += nch
    msg = next(ep.coll_seq) & PSN_MASK
    code = fr.dtype_from_name(dtype)
    src, dst, job = ep.node_id, ep.switch_id, st.job
    item = x.itemsize
    outb = out.view(np.uint8).data
    sock = ep.sock

    timers = ChunkTimers(ep.rtt, ep.timeout_s)
    flags = Flag.CRC if ep.crc else Flag.NONE

    def send(i: int, retx: bool = False) -> None:
        seg = x[i * E : min(n, (i + 1) * E)]
        header = fr.encode_header(Op.REDUCE, src=src, dst=dst, job=job,
                                  psn=(base + i) & PSN_MASK, dtype=code, msg=msg, payload=seg,
                                  flags=flags | (Flag.RETX if retx else 0), crc=ep.crc)
        ep.send(header, seg)

    now = time.monotonic()
    for i in range(min(S, nch)):
        send(i)
        timers.sent(i, now)
    got = bytearray(nch)
    done = 0
    hdr = memoryview(ep.hdr)
    what = f"allreduce ina job {job}"

    def resend(i: int) -> None:
        send(i, True)

    # In place, a corrupted result must not overwrite the input we may resend:
    # with CRC on, receive into a bounce buffer and copy after the check.
    bounce = memoryview(bytearray(E * item)) if ep.crc else None
    while done < nch:
        if not _wait_or_retransmit(ep, timers, resend, what):
            continue
        nh = sock.recv_into(ep.hdr)
        more = sock.get(zmq.RCVMORE)
        rop, _fl, _s, rjob, psn, _k, _o, length = fr.peek(hdr[:nh])
        i = (psn - base) & PSN_MASK
        if rop is Op.RESULT and rjob == job:
            if i >= nch or got[i] or not more:  # a late copy (we resent): drop it
                if more:
                    sock.recv(copy=False)
                ep.duplicates += 1
                continue
            lo = i * E * item
            target = outb[lo : lo + length]
            if target.nbytes != length:
                raise PeerFailed(f"{ep.name}: RESULT for chunk {i} has {length} B, "
                                 f"expected {min(n - i * E, E) * item} B")
            into = target if bounce is None else bounce[:length]
            nb = sock.recv_into(into)
            try:
                if nb != length:
                    raise fr.FrameError(fr.NackCode.MALFORMED, "truncated RESULT")
                fr.decode(hdr[:nh], into)  # full validation (CRC, dtype multiple)
            except fr.FrameError as exc:
                ep.bad_frames += 1  # counted; the chunk's timer will resend it
                log.info("%s: dropped a bad RESULT for chunk %d: %s", ep.name, i, exc)
                continue
            if bounce is not None:
                target[:] = into
            got[i] = 1
            done += 1
            _advance(timers, i, S, nch, send)
            continue
        payload = sock.recv(copy=False).buffer if more else None
        try:
            f = fr.decode(bytes(hdr[:nh]), payload)
        except fr.FrameError:
            ep.bad_frames += 1
            continue
        if f.op is Op.NACK and f.job == job:
            _on_nack(ep, f, base, nch, got, lambda i: send(i, True))
            continue
        ep.defer(f)
    ep.retransmits += timers.retransmits
    sem = ep.sem("ina")
    sem.chunks += nch
    sem.copies += nch  # recv_into the output (the switch counts its own copies)
    sem.crossings += nch * 2  # our payload to the switch, the result back to us
    sem.hops += nch


def _advance(timers: ChunkTimers, i: int, S: int, nch: int,
             send: Callable[[int, bool], None]) -> None:
    """Chunk ``i``'s result is in: resend chunks it overtook, send chunk ``i+S``
    into the slot it freed (the self-clocked window)."""
    now = time.monotonic()
    for lost in timers.acked(i, now)[1]:
        send(lost, True)
    if i + S < nch:
        send(i + S, False)
        timers.sent(i + S, now)


def _wait_or_retransmit(ep: Endpoint, timers: ChunkTimers, resend: Callable[[int], None],
                        what: str) -> bool:
    """Wait for a frame until the next chunk deadline; True when one is ready,
    else resend what expired and return False.

    A chunk without a result ``ep.timeout_s`` after its first send fails the
    operation, naming the switch.
    """
    deadline = timers.next_deadline()
    if deadline is not None:
        wait_ms = max(math.ceil((deadline - time.monotonic()) * 1000), 0)
        if transport.spin_poll(ep.sock, wait_ms):
            return True
    resend_now, dead = timers.expired(time.monotonic())
    if dead:
        raise FabricTimeout(
            f"{ep.name}: {what}: no result for chunk {dead[0]} from switch "
            f"{ep.switch_name!r} within {ep.timeout_s:g}s "
            f"({timers.retransmits} retransmissions); is it running?")
    for chunk in resend_now:
        resend(chunk)
    return False


#: NACK codes that mean "your frame was damaged on the way": send it again.
_RESEND_CODES = frozenset({fr.NackCode.BAD_CHECKSUM, fr.NackCode.MALFORMED})


def _on_nack(ep: Endpoint, f: fr.Frame, base: int, nch: int, got: bytearray,
             resend: Callable[[int], None]) -> None:
    """A damaged contribution is resent at once; any other refusal fails the call."""
    i = (f.psn - base) & PSN_MASK
    if f.nack_code in _RESEND_CODES:
        if i < nch and not got[i]:
            resend(i)
            ep.retransmits += 1
        return
    raise PeerFailed(f"{ep.name}: switch refused chunk {f.psn} of job {f.job}: "
                     f"{f.nack_code.name}")


def _next_frame(ep: Endpoint, timers: ChunkTimers, resend: Callable[[int], None],
                what: str, job: int) -> fr.Frame | None:
    """A stashed frame of ``job``, else one from the socket, else None (after
    handling timers). Bad frames are counted and dropped: their chunk's timer
    resends it."""
    for k, f in enumerate(ep.stash):
        if f.job == job and f.op in (Op.RESULT, Op.NACK):
            del ep.stash[k]
            return f
    if not _wait_or_retransmit(ep, timers, resend, what):
        return None
    parts = ep.sock.recv_multipart(copy=False)
    try:
        return fr.decode(parts[0].buffer, parts[1].buffer if len(parts) > 1 else None)
    except fr.FrameError as exc:
        ep.bad_frames += 1
        log.info("%s: dropped a bad frame: %s", ep.name, exc)
        return None


# ---------------------------------------------------------------------- ina-mem
def _scratch_region(ep: Endpoint, nbytes: int) -> np.ndarray:
    """A registered byte region of at least ``nbytes``, reused across calls."""
    if ep.scratch is None or ep.scratch.nbytes < nbytes:
        ep.scratch = ep.alloc(-(-nbytes // 8), "int64").view(np.uint8)
    return ep.scratch[:nbytes]


def allreduce_ina_mem(ep: Endpoint, x: np.ndarray, out: np.ndarray, op: str, dtype: str) -> None:
    """Memory-plane allreduce: the switch loads, reduces and stores in the regions."""
    st = _job(ep, "ina-mem", dtype, op, x.itemsize)
    if not st.granted:
        _fallback(ep, x, out, op, dtype, "ina-mem")
        return
    sem = ep.sem("ina-mem")
    S, n = st.slots, x.size
    # Large chunks save wake-ups, but a tensor needs several chunks in flight to
    # pipeline over (shaped) links: at least MEM_MIN_CHUNKS chunks when it can.
    floor = MEM_MIN_CHUNK_BYTES_SHAPED if ep.link_shaped else MEM_MIN_CHUNK_BYTES
    E = min(st.slot_elems, max(floor // x.itemsize, -(-n // MEM_MIN_CHUNKS)))
    nch = -(-n // E)
    loc = ep.region_of(out) if out is x else None
    work = out
    if loc is None:
        # Not reducing in place in registered memory: stage through a scratch region.
        work = _scratch_region(ep, x.nbytes).view(x.dtype)
        np.copyto(work, x)
        sem.copies += nch
        loc = ep.region_of(work)
        assert loc is not None
    key, base_off = loc
    base = st.next_chunk
    st.next_chunk += nch
    msg = next(ep.coll_seq) & PSN_MASK
    code = fr.dtype_from_name(dtype)
    item = x.itemsize

    timers = ChunkTimers(ep.rtt, ep.timeout_s)

    def send(i: int, retx: bool = False) -> None:
        count = min(n - i * E, E)
        ep.send(fr.encode_header(Op.REDUCE, src=ep.node_id, dst=ep.switch_id, job=st.job,
                                 psn=(base + i) & PSN_MASK, dtype=code, msg=msg, key=key,
                                 offset=base_off + i * E * item,
                                 flags=Flag.REF | (Flag.RETX if retx else 0),
                                 length=count * item, crc=ep.crc))

    now = time.monotonic()
    for i in range(min(S, nch)):
        send(i)
        timers.sent(i, now)
    got = bytearray(nch)
    done = 0
    while done < nch:
        f = _next_frame(ep, timers, lambda i: send(i, True), f"allreduce ina-mem job {st.job}",
                        st.job)
        if f is None:
            continue
        if f.op is Op.NACK and f.job == st.job:
            _on_nack(ep, f, base, nch, got, lambda i: send(i, True))
            continue
        if f.op is not Op.RESULT or f.job != st.job:
            ep.defer(f)
            continue
        i = (f.psn - base) & PSN_MASK
        if i >= nch or got[i]:  # a late copy of a result we already have
            ep.duplicates += 1
            continue
        got[i] = 1
        done += 1
        _advance(timers, i, S, nch, send)
    ep.retransmits += timers.retransmits
    if work is not out:
        np.copyto(out, work)
        sem.copies += nch
    sem.chunks += nch  # the switch counts its loads/stores into our region itself
    sem.hops += nch


# ---------------------------------------------------------------------- host-ps
def allreduce_host_ps(ep: Endpoint, x: np.ndarray, out: np.ndarray, op: str, dtype: str,
                      label: str = "host-ps") -> None:
    """Host-staged parameter-server allreduce through the host node."""
    host = ep.host_id
    if host is None:
        raise UsageError("host-ps needs a host node in the topology (kind = \"host\")")
    sem = ep.sem(label)
    E = _chunk_elems(ep, "host-ps", x.itemsize) // 2  # room for the msgpack envelope
    S = ep.slots.get("host-ps", DEFAULT_SLOTS["host-ps"])
    n = x.size
    nch = -(-n // E)
    msg = next(ep.coll_seq) & PSN_MASK
    hops, crossings = _route_cost(ep, host)
    staged = np.array(x, copy=True)  # device -> host staging copy
    result = np.empty_like(x)
    sem.copies += nch
    members = list(ep.worker_ids)

    def send(i: int) -> None:
        body = msgpack.packb({"seq": msg, "chunk": i, "members": members, "op": op,
                              "dtype": dtype, "data": staged[i * E : (i + 1) * E].data})
        sem.encodes += 1
        sem.copies += 1  # packing copies the payload into the message
        ep.send(fr.encode_header(Op.WRITE, src=ep.node_id, dst=host, flow=HOST_PS_FLOW,
                                 psn=i, msg=msg, payload=body), body)
        sem.hops += hops
        sem.crossings += crossings

    for i in range(min(S, nch)):
        send(i)
    done = 0
    got = bytearray(nch)

    def is_reply(f: fr.Frame) -> bool:
        return f.op is Op.WRITE and f.flow == HOST_PS_FLOW and f.msg == msg

    while done < nch:
        f = ep.wait_for(is_reply, f"allreduce host-ps seq {msg} chunk {done}/{nch}")
        reply = msgpack.unpackb(f.payload)
        sem.encodes += 1
        sem.copies += 1  # unpacking copies the payload out of the message
        i = int(reply["chunk"])
        if got[i]:
            continue
        got[i] = 1
        done += 1
        np.copyto(result[i * E : (i + 1) * E], np.frombuffer(reply["data"], dtype=x.dtype))
        sem.copies += 1
        # what the host did for our chunk, counted by the host node itself
        sem.copies += float(reply["h_copies"])
        sem.encodes += float(reply["h_encodes"])
        sem.hops += hops
        sem.crossings += crossings
        if i + S < nch:
            send(i + S)
    np.copyto(out, result)  # host -> device copy back
    sem.copies += nch
    sem.chunks += nch


# ---------------------------------------------------------------------- host-ring
def allreduce_host_ring(ep: Endpoint, x: np.ndarray, out: np.ndarray, op: str,
                        dtype: str, label: str = "host-ring") -> None:
    """Ring reduce-scatter + all-gather between workers, staged on the host."""
    sem = ep.sem(label)
    W, r, n = ep.world, ep.rank, x.size
    staged = np.array(x, copy=True)  # device -> host staging copy
    E = _chunk_elems(ep, "host-ring", x.itemsize)
    bounds = [(n * k) // W for k in range(W + 1)]
    nch_total = -(-n // E)
    sem.copies += nch_total
    if W == 1:
        np.copyto(out, staged)
        sem.copies += nch_total
        sem.chunks += nch_total
        return
    right = ep.worker_ids[(r + 1) % W]
    left = ep.worker_ids[(r - 1) % W]
    hops, crossings = _route_cost(ep, right)
    msg = next(ep.coll_seq) & PSN_MASK
    reduce = _REDUCE[op]
    code = fr.dtype_from_name(dtype)

    def seg(k: int) -> np.ndarray:
        return staged[bounds[k] : bounds[k + 1]]

    def exchange(step: int, send_k: int, recv_k: int, combine: bool) -> None:
        s = seg(send_k)
        frames_out = -(-s.size // E)
        for j in range(frames_out):
            part = s[j * E : (j + 1) * E]
            ep.send(fr.encode_header(Op.WRITE, src=ep.node_id, dst=right, flow=RING_FLOW,
                                     psn=(step << 16) | j, msg=msg, dtype=code, payload=part),
                    part)
            sem.hops += hops
            sem.crossings += crossings
        dst = seg(recv_k)
        frames_in = -(-dst.size // E)
        for j in range(frames_in):
            want = (step << 16) | j
            def is_part(f: fr.Frame, want: int = want) -> bool:
                return (f.op is Op.WRITE and f.flow == RING_FLOW and f.src == left
                        and f.msg == msg and f.psn == want)

            f = ep.wait_for(is_part, f"allreduce host-ring step {step} from node {left}")
            incoming = np.frombuffer(f.payload, dtype=x.dtype)
            target = dst[j * E : (j + 1) * E]
            if incoming.size != target.size:
                raise PeerFailed(f"{ep.name}: ring frame of {incoming.size} elements, "
                                 f"expected {target.size}")
            if combine:
                reduce(target, incoming, out=target)
            else:
                np.copyto(target, incoming)
            sem.copies += 1

    for step in range(W - 1):  # reduce-scatter
        exchange(step, (r - step) % W, (r - step - 1) % W, True)
    for step in range(W - 1):  # all-gather
        exchange(W - 1 + step, (r + 1 - step) % W, (r - step) % W, False)
    np.copyto(out, staged)  # host -> device copy back
    sem.copies += nch_total
    sem.chunks += nch_total


# ---------------------------------------------------------------------- fixed point
#: Elements per fixed-point scale block (SwitchML scales each packet's worth;
#: one scale per block keeps the extra max-allreduce small).
FIXED_BLOCK = 16384


def allreduce_fixed(ep: Endpoint, x: np.ndarray, out: np.ndarray, path: str) -> None:
    """Sum float32 ``x`` as fixed-point int32 with a per-block scale.

    Every worker first agrees on each block's largest magnitude (a max
    allreduce of one float per block), picks the power-of-two scale under
    which ``world`` quantised values cannot overflow int32, sums the integers
    on ``path`` and scales back. Integer sums do not depend on arrival order,
    so the result is bitwise the same on every path and every run.
    """
    from kernels.reference import choose_scale, dequantize, quantize

    if x.dtype != np.float32:
        raise UsageError("fixed-point numerics take float32 tensors")
    n = x.size
    nblk = -(-n // FIXED_BLOCK)
    pad = np.zeros(nblk * FIXED_BLOCK, np.float32)
    pad[:n] = np.abs(x)
    maxima = pad.reshape(nblk, FIXED_BLOCK).max(axis=1)
    # the scalar agreement travels in-network too (ina for the memory plane:
    # a few bytes are not worth a region)
    side = "ina" if path == "ina-mem" else path
    ep.allreduce(maxima, op="max", path=side, out=maxima)
    q = _scratch_ints(ep, n) if path == "ina-mem" else np.empty(n, np.int32)
    scales = [choose_scale(float(m), ep.world, 32) for m in maxima]
    for b, scale in enumerate(scales):
        lo, hi = b * FIXED_BLOCK, min(n, (b + 1) * FIXED_BLOCK)
        q[lo:hi] = quantize(x[lo:hi], scale, "int32")
    ep.allreduce(q, op="sum", path=path, out=q)
    for b, scale in enumerate(scales):
        lo, hi = b * FIXED_BLOCK, min(n, (b + 1) * FIXED_BLOCK)
        out[lo:hi] = dequantize(q[lo:hi], scale)


def _scratch_ints(ep: Endpoint, n: int) -> np.ndarray:
    """A registered int32 region for the memory plane's fixed-point sum."""
    if ep.fixed_scratch is None or ep.fixed_scratch.size < n:
        ep.fixed_scratch = ep.alloc(n, "int32")
    return ep.fixed_scratch[:n]
