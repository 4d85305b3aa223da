"""Fabric tasks of the generation and transport layers: the generator and the relay.

:func:`generate` runs on a worker node, which stands in for a GPU. It keeps a
batch of sequences (continuous batching: requests join and leave between
steps) and runs the toy decoder on them; each step takes the configured step
time, of which the real kernel arithmetic is a part (a step that admits new
requests is a prefill step and takes ``prefill_ms``). At the end of each step
the new token of every sequence leaves the "device":

* ``direct``: the step's records are written, as one memory-semantic WRITE
  frame (two when the ring wraps), at the worker's offset of the host's token
  ring. No serialisation: a record is 32 fixed bytes.
* ``host-staged``: the ids are copied to host objects (the staging copy),
  packed into a msgpack message and sent to the relay node, which decodes,
  stamps and re-encodes it for the front-end host (:func:`relay`).

Semantic distance is counted where it happens (per token): the generator and
relay return their counts; the host adds its own.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, NackCode, Op
from fabric.core.semantic import SemanticCounts
from fabric.emulation import doorbell as db
from fabric.emulation.shm import SharedRegion, is_semfab_file
from fabric.serving import records as rec
from fabric.serving.clock import now_ns
from fabric.serving.config import ServeConfig

log = logging.getLogger("semfab.serving.generator")

#: The prefill kernel runs over at most this many trailing prompt tokens.
PREFILL_KERNEL_TOKENS = 256
#: Step statistics kept (oldest dropped) so a long `semfab serve` stays bounded.
MAX_STEP_LOG = 200_000
#: Token frames kept to resend when the host NACKs one as missing (one frame
#: per step: at 10 ms steps, 40 s of history).
KEPT_FRAMES = 4096
#: Request ids remembered so a resent ADD (its first copy was late, not lost)
#: does not start a sequence twice.
SEEN_RIDS = 65536
#: An idle generator sends the host its next frame number this often, for this
#: long after its last frame: a lost last frame is found by that probe (the
#: host NACKs it) rather than by the client's timeout.
PROBE_INTERVAL_MS = 100
PROBE_FOR_S = 2.0


class _Stop(Exception):
    """The host (or a signal) asked the task to end."""


class _Batch:
    """The running sequences, as arrays of one row per sequence (swap-remove)."""

    def __init__(self, cap: int, dim: int) -> None:
        self.cap = cap
        self.n = 0
        self.rid = np.zeros(cap, np.uint32)
        self.index = np.zeros(cap, np.int64)  # index of the next token to emit
        self.max_tokens = np.zeros(cap, np.int64)
        self.toy = np.zeros(cap, np.int32)  # last toy token (decoder input)
        self.hidden = np.zeros((cap, dim), np.float32)
        self.pos = np.zeros(cap, np.int32)
        self.cursor = np.zeros(cap, np.int64)
        self.temp = np.zeros(cap, np.float64)
        self.seed = np.zeros(cap, np.uint64)  # the request's own seed, where it gave one
        self.seeded = np.zeros(cap, bool)
        self.fresh = np.zeros(cap, bool)  # admitted this step: needs prefill
        self.prompts: list[list[int]] = [[] for _ in range(cap)]

    def add(self, rid: int, prompt: list[int], max_tokens: int, temp: float, cursor: int,
            seed: int | None = None) -> None:
        j = self.n
        self.rid[j] = rid
        self.index[j] = 0
        self.max_tokens[j] = max_tokens
        self.hidden[j] = 0.0
        self.pos[j] = 0
        self.cursor[j] = cursor
        self.temp[j] = temp
        self.seeded[j] = seed is not None
        self.seed[j] = 0 if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF
        self.fresh[j] = True
        self.prompts[j] = prompt or [0]
        self.n += 1

    def remove(self, j: int) -> None:
        last = self.n - 1
        if j != last:
            for a in (self.rid, self.index, self.max_tokens, self.toy, self.hidden, self.pos,
                      self.cursor, self.temp, self.seed, self.seeded, self.fresh):
                a[j] = a[last]
            self.prompts[j] = self.prompts[last]
        self.n -= 1

    def find(self, rid: int) -> int | None:
        hits = np.flatnonzero(self.rid[: self.n] == rid)
        return int(hits[0]) if hits.size else None


def retire(b: _Batch) -> list[int]:
    """After a step that gave every sequence of ``b`` a token: count it, and remove
    the sequences that reached their ``max_tokens`` (their request ids, in the
    order removed: every copy of a batch removes alike)."""
    n = b.n
    b.index[:n] += 1
    gone = []
    for j in sorted(np.flatnonzero(b.index[:n] >= b.max_tokens[:n]).tolist(), reverse=True):
        gone.append(int(b.rid[j]))
        b.remove(j)
    return gone


class Generator:
    """One worker's generation loop (driven by :func:`generate`)."""

    def __init__(self, ep: Any, cfg: ServeConfig) -> None:
        from fabric.serving.assets import CorpusWalk, local_assets

        self.ep = ep
        self.cfg = cfg
        self.backend_name = self._load_model()
        self.walk = CorpusWalk.load(local_assets(cfg.assets_dir))
        self.batch = _Batch(cfg.max_batch, cfg.toy_dim)
        self.pending: deque[dict[str, Any]] = deque()
        self.host_id: int = ep.topo.node("host0").id
        self.session = cfg.session
        self.job = cfg.session & 0xFFFF
        self.out = np.zeros(cfg.max_batch, rec.RECORD_DTYPE)  # the step's records
        self.out_bytes = self.out.view(np.uint8)
        self.ring_key = 0
        self.ring_base = 0
        self.ring_slots = cfg.ring_slots
        self.sent_records = 0
        self.psn = 0
        self.relay_id = 0
        self.hops = 0
        self.sem = SemanticCounts()
        self.generated: dict[int, list[int]] = {}
        self.aborted: list[int] = []
        # (t_gen, target ns, actual ns, rows, prefill) per step
        self.steps: deque[tuple[int, int, int, int, bool]] = deque(maxlen=MAX_STEP_LOG)
        self.tokens = 0
        # cfg.bells: host0's ring mapped here, and the doorbell to host0
        self.shared_ring: SharedRegion | None = None
        self.bell: db.Doorbell | None = None
        self.bell_frames = 0
        self.stop = False
        self.configured = False
        self._parent = os.getppid()
        self._kept: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()  # psn -> frame
        self._seen: deque[int] = deque()
        self._seen_set: set[int] = set()
        self._last_send = 0.0
        self.resent = 0  # token frames sent again on a NACK
        self.unrecoverable = 0  # NACKed frames no longer kept
        # the chain's frames (host0's control messages, its NACKs of token frames)
        # reach us through the endpoint's inbox, even while a collective runs
        ep.app_filter = self._ours

    def _load_model(self) -> str:
        """Load the toy decoder and its kernel backend; the backend's name."""
        from kernels import ToyDecoder

        cfg = self.cfg
        self.backend = self._kernels()
        self.weights = ToyDecoder(cfg.toy_vocab, cfg.toy_dim, cfg.seed)
        return str(self.backend.name)

    def _kernels(self) -> Any:
        """The kernel backend ``--backend`` names, its threads limited."""
        from kernels import get_backend

        backend = get_backend(self.cfg.backend)
        if backend.name == "numba-cpu":
            import numba

            # one "GPU" per process: leave the other cores to the rest of the chain
            limit = int(getattr(numba.config, "NUMBA_NUM_THREADS", 1))
            numba.set_num_threads(max(1, min(self.cfg.kernel_threads, limit)))
        return backend

    def _ours(self, f: fr.Frame) -> bool:
        """A frame of the chain: host0's control message, or its NACK of a token frame."""
        if f.op is Op.CTRL:
            return f.src == self.host_id
        return f.op is Op.NACK and f.flow in (rec.TOKEN_FLOW, rec.STAGED_FLOW)

    # ------------------------------------------------------------------ control
    def warm_up(self) -> None:
        """Compile / warm the kernel before the chain reports ready."""
        w = self.weights
        for b in (1, self.batch.cap):
            self.backend.decoder_step(w, np.zeros(b, np.int32), w.init_hidden(b),
                                      np.zeros(b, np.int32), 1.0, 0)

    def _ctrl(self, t: str, **fields: Any) -> None:
        self.ep.send_frame(fr.encode(Op.CTRL, src=self.ep.node_id, dst=self.host_id,
                               payload=control.pack(t, session=self.session, **fields)))

    def poll_control(self, timeout_ms: int) -> None:
        """Handle every frame of the chain waiting (wait up to ``timeout_ms`` for one)."""
        ep = self.ep
        if timeout_ms and not ep.inbox:
            ep.wait(timeout_ms)
        ep.drain_idle()
        while ep.inbox:
            f = ep.inbox.popleft()
            if f.op is Op.NACK:
                self.on_nack(f)
                continue
            try:
                msg = control.parse(f.payload)
            except FrameError as exc:
                log.warning("%s: refused a frame: %s", ep.name, exc)
                continue
            if msg.get("session") != self.session:
                continue  # a leftover of an earlier chain on this fabric
            self.on_control(msg)

    def on_nack(self, f: fr.Frame) -> None:
        """The host found a token frame missing: send the kept copy again."""
        if f.flow not in (rec.TOKEN_FLOW, rec.STAGED_FLOW) or f.nack_code is not NackCode.MISSING:
            log.warning("%s: NACK %s from node %d", self.ep.name, f.nack_code.name, f.src)
            return
        kept = self._kept.get(f.psn)
        if kept is None:
            self.unrecoverable += 1
            log.warning("%s: the host asked again for token frame %d, no longer kept",
                        self.ep.name, f.psn)
            return
        header, payload = kept
        self.ep.send_frame(header, payload)
        self.resent += 1

    def _keep(self, psn: int, header: bytes, payload: bytes) -> None:
        self._kept[psn & 0xFFFF_FFFF] = (header, payload)
        if len(self._kept) > KEPT_FRAMES:
            self._kept.popitem(last=False)
        self._last_send = time.monotonic()

    def _probe(self) -> None:
        """Idle after sending: tell the host the next frame number (tail-loss probe)."""
        if self.psn and time.monotonic() - self._last_send < PROBE_FOR_S:
            self._ctrl(rec.SENT, psn=self.psn & 0xFFFF_FFFF,
                       staged=self.cfg.transport == "host-staged")

    def ready_fields(self) -> dict[str, Any]:
        """What READY tells host0 beyond the worker's name and doorbell."""
        return {}

    def on_control(self, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == rec.ADD:
            rid = int(msg["rid"])
            if rid in self._seen_set:
                return  # a resent ADD whose first copy came after all
            self._seen.append(rid)
            self._seen_set.add(rid)
            if len(self._seen) > SEEN_RIDS:
                self._seen_set.discard(self._seen.popleft())
            self.pending.append(msg)
        elif t == rec.ABORT:
            rid = int(msg["rid"])
            j = self.batch.find(rid)
            if j is not None:
                self.batch.remove(j)
                self.aborted.append(rid)
            else:
                before = len(self.pending)
                self.pending = deque(m for m in self.pending if m["rid"] != rid)
                if len(self.pending) != before:
                    self.aborted.append(rid)
        elif t == rec.CONFIG:
            self.configured = True
            self.ring_key = int(msg["ring_key"])
            self.ring_base = int(msg["ring_base"])
            self.ring_slots = int(msg["ring_slots"])
            self.relay_id = int(msg.get("relay_id", 0))
            dst = self.relay_id if self.cfg.transport == "host-staged" else self.host_id
            self.hops = len(self.ep.topo.route(self.ep.name, self.ep.topo.by_id(dst).name))
            bell = self._open_bell(str(msg.get("ring_path") or ""))
            self._ctrl(rec.READY, worker=self.ep.name, bell=bell, **self.ready_fields())
        elif t == rec.STOP:
            self._ctrl(rec.STOPPED)
            self.stop = True

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until the host says stop (or the launcher goes away)."""
        cfg = self.cfg
        next_start = 0  # steps keep a fixed cadence while the batch is busy
        while not self.stop:
            if self.batch.n == 0 and not self.pending:
                self.poll_control(PROBE_INTERVAL_MS)
                if self.batch.n == 0 and not self.pending:
                    self._probe()
                if os.getppid() != self._parent:
                    log.warning("%s: launcher went away", self.ep.name)
                    return
                next_start = 0
                continue
            self.poll_control(0)
            if self.stop:
                return
            t0 = now_ns()
            if next_start and 0 <= t0 - next_start < int(cfg.step_ms * 1e6):
                t0 = next_start  # emitting the last step's tokens is part of this step
            fresh = self._admit()
            if self.batch.n == 0:
                continue
            self._kernel()
            if fresh:
                prompt_len = sum(len(p) for p in self.batch.prompts[: self.batch.n])
                target = cfg.prefill_ms + cfg.prefill_ms_per_token * prompt_len
            else:
                target = cfg.step_ms
            target_ns = int(target * 1e6)
            rest = t0 + target_ns - now_ns()
            if rest > 0:
                time.sleep(rest / 1e9)
            t_gen = now_ns()
            next_start = t0 + target_ns
            self.steps.append((t_gen, target_ns, t_gen - t0, self.batch.n, fresh))
            self._emit()

    def _admit(self) -> bool:
        b = self.batch
        fresh = False
        while self.pending and b.n < b.cap:
            m = self.pending.popleft()
            temp = self.cfg.temperature if m.get("temperature") is None else m["temperature"]
            seed = m.get("seed")
            b.add(int(m["rid"]), list(m["prompt"]), int(m["max_tokens"]), float(temp),
                  int(m["start"]), None if seed is None else int(seed))
            if self.cfg.record:
                self.generated[int(m["rid"])] = []
            fresh = True
        return fresh

    def _step_rows(self, rows: np.ndarray) -> None:
        """One decoder step for ``rows``: one kernel call per temperature, and one per
        seeded sequence that samples.

        The kernel's noise is keyed by (seed, row in the call, position), so a
        sequence with its own seed runs alone (row 0): its tokens then depend
        on its prompt, seed and temperature only, not on who shares the batch.
        """
        b = self.batch
        temps = b.temp[rows]
        alone = b.seeded[rows] & (temps > 0)
        for j in rows[alone]:
            self._call(np.array([j]), float(b.temp[j]), int(b.seed[j]))
        rest, temps = rows[~alone], temps[~alone]
        for t in np.unique(temps):
            self._call(rest[temps == t], float(t), self.cfg.seed)

    def _call(self, r: np.ndarray, temperature: float, seed: int) -> None:
        b = self.batch
        toks, hid = self.backend.decoder_step(self.weights, b.toy[r], b.hidden[r], b.pos[r],
                                              temperature, seed)
        b.toy[r] = toks
        b.hidden[r] = hid
        b.pos[r] += 1

    def _kernel(self) -> None:
        b = self.batch
        n = b.n
        fresh = np.flatnonzero(b.fresh[:n])
        for j in fresh:  # prefill: the prompt's toy ids through the decoder
            prompt = b.prompts[j][-PREFILL_KERNEL_TOKENS:]
            toy = np.asarray(prompt, np.int64) % self.cfg.toy_vocab
            for tok in toy:
                b.toy[j] = tok
                self._step_rows(np.array([j]))
            b.fresh[j] = False
            b.prompts[j] = []
        running = np.setdiff1d(np.arange(n), fresh, assume_unique=True)
        if running.size:
            self._step_rows(running)

    def text_ids(self, n: int) -> np.ndarray:
        """Tokenizer ids of the batch's first ``n`` new tokens: the corpus walk."""
        b = self.batch
        return self.walk.step(b.toy[:n], b.cursor[:n])

    def _emit(self) -> list[int]:
        """Send the step's tokens of the batch to the host, then retire what finished
        (their request ids)."""
        b = self.batch
        n = b.n
        ids = self.text_ids(n)
        # a token is generated once its id is chosen: sampling is the step's last
        # part (the step's own start and cadence keep the time it was due)
        t_gen = now_ns()
        out = self.out
        out["rid"][:n] = b.rid[:n]
        out["index"][:n] = b.index[:n]
        out["token"][:n] = ids
        last = b.index[:n] + 1 >= b.max_tokens[:n]
        out["flags"][:n] = np.where(last, rec.LAST, 0)
        out["t_gen"][:n] = t_gen
        self.sem.chunks += n
        if self.cfg.transport == "direct":
            self._send_direct(n)
        else:
            self._send_staged(n)
        if self.cfg.record:
            for rid, tok in zip(b.rid[:n].tolist(), ids.tolist(), strict=True):
                self.generated[rid].append(tok)
        self.tokens += n
        return retire(b)

    def _open_bell(self, ring_path: str) -> str:
        """With ``cfg.bells`` and host0's ring in shared memory on this host: map the
        ring and open a doorbell to host0; the doorbell's path ("" when not)."""
        if self.bell is not None:
            return str(self.bell.path)  # a repeated CONFIG
        if not (self.cfg.bells and ring_path and db.enabled()):
            return ""
        if not is_semfab_file(ring_path):
            log.warning("%s: refused token ring path %s", self.ep.name, ring_path)
            return ""
        try:
            self.shared_ring = SharedRegion.attach(ring_path, os.stat(ring_path).st_size)
            self.bell = db.Doorbell.create(
                f"semfab-{self.ep.run_id}-{self.ep.name}-tokens-{self.session:x}")
        except (OSError, ValueError) as exc:  # another host after all: the socket
            log.info("%s: token ring not mapped (%s); tokens go over the socket",
                     self.ep.name, exc)
            self._close_bell()
            return ""
        return str(self.bell.path)

    def _close_bell(self) -> None:
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.shared_ring is not None:
            self.shared_ring.close()
            self.shared_ring = None

    def _send_direct(self, n: int) -> None:
        """WRITE the step's records into the host's token ring (no serialisation):
        over the socket, or (doorbells) straight into the shared ring, then the
        header alone through the doorbell."""
        slot = self.sent_records % self.ring_slots
        first = min(n, self.ring_slots - slot)
        self.out["t_sent"][:n] = now_ns()
        self.sem.copies += n  # the sampler's ids stored as records in the send buffer
        for lo, hi, s in ((0, first, slot), (first, n, 0)):
            if hi <= lo:
                continue
            payload = self.out_bytes[lo * rec.RECORD_SIZE: hi * rec.RECORD_SIZE]
            offset = self.ring_base + s * rec.RECORD_SIZE
            header = fr.encode_header(
                Op.WRITE, src=self.ep.node_id, dst=self.host_id, job=self.job,
                flow=rec.TOKEN_FLOW, psn=self.psn & 0xFFFF_FFFF, key=self.ring_key,
                offset=offset, payload=payload)
            body = bytes(payload)  # the buffer is reused next step; kept for a resend
            self._keep(self.psn, header, body)
            self.psn += 1
            if self.bell is not None and self._ring_write(offset, body):
                self.sem.copies += hi - lo  # send buffer -> host0's ring
                continue
            sock = self.ep.sock
            sock.send(header, zmq.SNDMORE)
            sock.send(body)
        self.sent_records += n
        self.sem.crossings += n  # worker -> switch (or -> host0, through the doorbell)
        self.sem.hops += n * self.hops

    def _ring_write(self, offset: int, body: bytes) -> bool:
        """Store ``body`` in host0's ring at ``offset`` and post the WRITE's header
        (Flag.REF: the records are in place) through the doorbell; False when host0
        is behind or the doorbell is full (then the frame goes over the socket)."""
        assert self.bell is not None and self.shared_ring is not None
        n = len(body)
        # each unread descriptor holds at most max_batch records of our part of the
        # ring: never write over records host0 has not read yet (the socket path
        # cannot, host0 itself receives into the ring, in order)
        if (self.bell.backlog() + 1) * self.cfg.max_batch > self.ring_slots:
            return False
        buf = self.shared_ring.buffer()
        buf[offset: offset + n] = body  # the records, before the descriptor (TSO)
        header = fr.encode_header(
            Op.WRITE, src=self.ep.node_id, dst=self.host_id, job=self.job,
            flow=rec.TOKEN_FLOW, psn=(self.psn - 1) & 0xFFFF_FFFF, key=self.ring_key,
            offset=offset, length=n, flags=Flag.REF)
        # host0 asleep: hand it the CPU now, our next step's work can wait
        if not self.bell.send(header, handoff=True):
            return False
        self.bell_frames += 1
        return True

    def _send_staged(self, n: int) -> None:
        """Staging copy, msgpack, and off to the relay process."""
        o = self.out[:n]
        cols = [o["rid"].tolist(), o["index"].tolist(), o["token"].tolist(),
                o["flags"].tolist(), o["t_gen"].tolist()]  # device -> host staging copy
        self.sem.copies += n
        t_sent = now_ns()
        rows = [[r, i, t, f, g, t_sent] for r, i, t, f, g in zip(*cols, strict=True)]
        body = rec.pack_staged(self.session, self.psn, self.ep.node_id, rows)
        self.sem.encodes += n
        self.sem.copies += n  # packing copies every record into the message
        header = fr.encode_header(Op.WRITE, src=self.ep.node_id, dst=self.relay_id,
                                  job=self.job, flow=rec.STAGED_FLOW,
                                  psn=self.psn & 0xFFFF_FFFF, payload=body)
        self._keep(self.psn, header, body)
        self.psn += 1
        self.ep.send_frame(header, body)
        self.sem.crossings += n
        self.sem.hops += n * self.hops

    def result(self) -> dict[str, Any]:
        """What the task returns to the launcher."""
        steps = np.array(self.steps, dtype=np.int64).reshape(-1, 5)
        return {
            "node": self.ep.name, "tokens": self.tokens, "aborted": self.aborted,
            "generated": self.generated, "sem": self.sem.__dict__.copy(),
            "steps": steps, "backend": self.backend_name,
            "resent_frames": self.resent, "unrecoverable_frames": self.unrecoverable,
            "bell_frames": self.bell_frames,
        }


def _wait_config(g: Generator, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not g.configured and not g.stop:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{g.ep.name}: no configuration from host0 within {timeout_s:g}s")
        g.poll_control(100)


def generate(ep: Any, cfg: ServeConfig, kind: type[Generator] = Generator) -> dict[str, Any]:
    """Worker task: generate tokens for the host's requests until it says stop
    (``kind``: the generator's class, the toy decoder's by default)."""
    g = kind(ep, cfg)
    g.warm_up()
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_: object) -> None:
        g.stop = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        _wait_config(g, max(cfg.token_timeout_s, 30.0))
        g.run()
    except Exception as exc:
        try:  # tell the host, so its streams fail now rather than time out
            g._ctrl(rec.FAIL, worker=ep.name, error=f"{type(exc).__name__}: {exc}")
        except Exception:  # the socket itself may be what failed
            pass
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        g._close_bell()
    return g.result()


def relay(ep: Any, cfg: ServeConfig) -> dict[str, Any]:
    """Host-staged relay task: decode each staged message, stamp it, re-encode it onward.

    Stands for the CPU process a host-staged design puts between the engine
    and the front end (an output/IPC process): it really pays for a receive,
    a msgpack decode, an encode and a send per message.
    """
    host_id = ep.topo.node("host0").id
    sem = SemanticCounts()
    stop = False
    messages = 0
    psn = 0
    parent = os.getppid()
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock = ep.sock
    out_hops = len(ep.topo.route(ep.name, "host0"))
    try:
        while not stop:
            if not sock.poll(100):
                if os.getppid() != parent:
                    break
                continue
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                t_in = now_ns()
                try:
                    f = fr.decode(parts[0].buffer, parts[1].buffer if len(parts) > 1 else None)
                    if f.op is Op.WRITE and f.flow == rec.STAGED_FLOW:
                        msg = rec.unpack_staged(f.payload)
                        if msg["s"] != cfg.session:
                            continue
                        n = len(msg["r"])
                        sem.chunks += n
                        sem.crossings += n  # switch -> relay
                        sem.encodes += n  # unpack
                        sem.copies += n  # unpack copies the records out of the message
                        msg["ri"] = t_in
                        msg["ro"] = now_ns()
                        body = rec.repack_staged(msg)
                        sem.encodes += n
                        sem.copies += n
                        ep.send_frame(fr.encode_header(Op.WRITE, src=ep.node_id, dst=host_id,
                                                 job=f.job, flow=rec.STAGED_FLOW,
                                                 psn=psn & 0xFFFF_FFFF, payload=body), body)
                        psn += 1
                        messages += 1
                        sem.crossings += n  # relay -> switch
                        sem.hops += n * out_hops
                    elif f.op is Op.CTRL:
                        m = control.parse(f.payload)
                        if m.get("session") != cfg.session:
                            continue
                        if m["t"] == rec.PING:
                            ep.send_frame(fr.encode(Op.CTRL, src=ep.node_id, dst=f.src,
                                              payload=control.pack(rec.PONG,
                                                                   session=cfg.session)))
                        elif m["t"] == rec.STOP:
                            ep.send_frame(fr.encode(Op.CTRL, src=ep.node_id, dst=f.src,
                                              payload=control.pack(rec.STOPPED,
                                                                   session=cfg.session)))
                            stop = True
                except FrameError as exc:
                    log.warning("relay: refused a frame: %s", exc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"node": ep.name, "messages": messages, "sem": sem.__dict__.copy()}
